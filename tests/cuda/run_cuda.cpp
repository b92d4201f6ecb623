// Runs our CUDA code (ggml-patches/src/cuda: the kernels and the host functions that launch them, unchanged but for
// the launch syntax) on the CPU through the emulation in shim/cuda_emu.h. Each command builds the op's ggml tensors in
// host memory and calls the entry point the CUDA backend calls (ggml_rq_cuda_*), so the launch configuration under
// test is the shipped one. Driven by tests/cuda/test_emulation.py, which makes the inputs with ggml's C reference and
// checks the outputs. ORDER: 0 runs each block's lanes forward, 1 in reverse. Files are raw little-endian arrays.
//
//   run_cuda set_rows TYPE IDX NE00 N_ROWS NE02 ORDER IN OUT
//     IN F32 [NE02][N_ROWS][NE00]; row i of every head goes to row N_ROWS-1-i (IDX i32 or i64 ids); OUT TYPE rows.
//   run_cuda cpy SRC DST NE00 N_ROWS ORDER IN OUT
//     CPY of N_ROWS rows (f32, f16 or a type of ours on either side) from a strided view (rows one block apart
//     more than their size) to contiguous rows.
//   run_cuda get_rows TYPE DST NE00 N_ROWS ORDER IN OUT     rows gathered in reverse order, as DST (f32/f16/bf16)
//   run_cuda to TYPE DST NE00 N_ROWS ORDER IN OUT           the to_fp32/fp16/bf16 dequantiser (contiguous)
//   run_cuda to_nc TYPE DST NE00 N_ROWS ORDER IN OUT        its _nc twin over rows one block apart more
//   run_cuda mmvq NE00 N_ROWS N_COLS N_CH ORDER W X OUT
//     MUL_MAT: ITQ3_S W [N_ROWS][NE00] (one matrix for N_CH channels) x F32 X [N_CH][N_COLS][NE00]:
//     OUT F32 [N_CH][N_COLS][N_ROWS]
//   run_cuda mmvq_id NE00 N_ROWS N_EXPERT N_USED N_XROW N_TOK ORDER W X IDS OUT
//     MUL_MAT_ID: W [N_EXPERT][N_ROWS][NE00], X [N_TOK][N_XROW][NE00], IDS I32 [N_TOK][N_USED]:
//     OUT [N_TOK][N_USED][N_ROWS]
//   run_cuda fa KTYPE VTYPE D N_Q N_HEAD N_HEAD_KV N_KV N_SEQ SCALE SOFTCAP MAX_BIAS N_SM ORDER Q K V MASK SINKS OUT
//     FLASH_ATTN_EXT in ggml's layouts: Q F32 [N_SEQ][N_HEAD][N_Q][D], K/V rows [N_SEQ][N_HEAD_KV][N_KV] of KTYPE/VTYPE
//     (f16, q8_0 or IsoQuant), MASK F16 [N_Q][N_KV] or "-", SINKS F32 [N_HEAD] or "-"; N_SM: the GPU's SM count
//     the host code sizes its KV splits for; OUT F32 [N_SEQ][N_Q][N_HEAD][D].
// Every command prints one line to stdout: the launches and blocks it ran and the __shared__ bytes poisoned; each op
// it runs must be one ggml_rq_cuda_supports_op (or, for the attention, ggml_rq_cuda_fattn_supported) claims.

#include "ggml-cuda/common.cuh"
#include "ggml-cuda/convert.cuh"
#include "rq-cuda.cuh"

#include "../emu/io.h"

#include <cstdio>
#include <string>
#include <vector>

// ---------------------------------------------------------------------------------------------------------------
// files and tensors

static void write_out(const char * path, const void * data, size_t n) {
    if (write_bytes(path, data, n) != 0) {
        exit(2);
    }
}

// the backend runs an op on the GPU only where ggml_rq_cuda_supports_op says yes: every op run here must be one
static void claimed(const ggml_tensor * op) {
    if (ggml_rq_cuda_supports_op(op) != 1) {
        fprintf(stderr, "%s: ggml_rq_cuda_supports_op says %d for an op its kernels run\n", ggml_op_desc(op),
                ggml_rq_cuda_supports_op(op));
        exit(1);
    }
}

static ggml_type type_of(const std::string & name) {
    if (name == "f32") return GGML_TYPE_F32;
    if (name == "f16") return GGML_TYPE_F16;
    if (name == "bf16") return GGML_TYPE_BF16;
    if (name == "i32") return GGML_TYPE_I32;
    if (name == "i64") return GGML_TYPE_I64;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && name == n) {
            return (ggml_type) t;
        }
    }
    fprintf(stderr, "unknown type %s\n", name.c_str());
    exit(2);
}

// a context whose tensors live in host memory, filled with 0xff (what device memory holds before a kernel writes it)
struct host_ctx {
    ggml_context * ctx;
    explicit host_ctx(size_t bytes) {
        ggml_init_params ip = { bytes + 64*ggml_tensor_overhead(), nullptr, false };
        ctx = ggml_init(ip);
        memset(ggml_get_mem_buffer(ctx), 0xff, ggml_get_mem_size(ctx));
    }
    ~host_ctx() { ggml_free(ctx); }
};

static void fill(ggml_tensor * t, const std::vector<unsigned char> & src) {
    if (src.size() != ggml_nbytes(t)) {
        fprintf(stderr, "%s: input has %zu bytes, expected %zu\n", ggml_get_name(t), src.size(), ggml_nbytes(t));
        exit(2);
    }
    memcpy(t->data, src.data(), src.size());
}

// N_ROWS rows of NE00 values, one block apart more than their size (a strided view of a wider tensor)
static ggml_tensor * strided_rows(ggml_context * ctx, ggml_type type, int64_t ne00, int64_t n_rows) {
    ggml_tensor * base = ggml_new_tensor_2d(ctx, type, ne00 + ggml_blck_size(type), n_rows);
    return ggml_view_2d(ctx, base, ne00, n_rows, base->nb[1], 0);
}

static void copy_in_rows(ggml_tensor * v, const std::vector<unsigned char> & src) {
    const size_t row = ggml_row_size(v->type, v->ne[0]);
    if (src.size() != row*v->ne[1]) {
        fprintf(stderr, "input has %zu bytes, expected %zu\n", src.size(), row*v->ne[1]);
        exit(2);
    }
    for (int64_t i = 0; i < v->ne[1]; ++i) {
        memcpy((char *) v->data + i*v->nb[1], src.data() + i*row, row);
    }
}

static void report() {
    printf("launches %lu blocks %lu shared_bytes %zu\n", rq_cuda::launches, rq_cuda::blocks, rq_cuda::shared_bytes());
}

// ---------------------------------------------------------------------------------------------------------------
// commands

static int cmd_set_rows(char ** a) {
    const ggml_type t = type_of(a[0]), it = type_of(a[1]);
    const int64_t ne00 = atoll(a[2]), n_rows = atoll(a[3]), ne02 = atoll(a[4]);
    host_ctx h(2*(size_t) ne00*n_rows*ne02*sizeof(float) + 1024*1024);
    ggml_tensor * x   = ggml_new_tensor_3d(h.ctx, GGML_TYPE_F32, ne00, n_rows, ne02);
    ggml_tensor * ids = ggml_new_tensor_1d(h.ctx, it, n_rows);
    ggml_tensor * dst = ggml_new_tensor_3d(h.ctx, t, ne00, n_rows, ne02);
    fill(x, read_all(a[6]));
    for (int64_t i = 0; i < n_rows; ++i) {
        if (it == GGML_TYPE_I64) {
            ((int64_t *) ids->data)[i] = n_rows - 1 - i;
        } else {
            ((int32_t *) ids->data)[i] = (int32_t) (n_rows - 1 - i);
        }
    }
    ggml_tensor * op = ggml_set_rows(h.ctx, dst, x, ids);
    claimed(op);
    ggml_backend_cuda_context cctx;
    if (!ggml_rq_cuda_set_rows(cctx, op)) {
        fprintf(stderr, "set_rows: not taken\n");
        return 1;
    }
    write_out(a[7], dst->data, ggml_nbytes(dst));
    return 0;
}

static int cmd_cpy(char ** a) {
    const ggml_type ts = type_of(a[0]), td = type_of(a[1]);
    const int64_t ne00 = atoll(a[2]), n_rows = atoll(a[3]);
    host_ctx h(4*(size_t) ne00*n_rows*sizeof(float) + 1024*1024);
    ggml_tensor * src = strided_rows(h.ctx, ts, ne00, n_rows);
    ggml_tensor * dst = ggml_new_tensor_2d(h.ctx, td, ne00, n_rows);
    copy_in_rows(src, read_all(a[5]));
    claimed(ggml_cpy(h.ctx, src, dst));
    ggml_backend_cuda_context cctx;
    if (!ggml_rq_cuda_cpy(cctx, src, dst)) {
        fprintf(stderr, "cpy: not taken\n");
        return 1;
    }
    write_out(a[6], dst->data, ggml_nbytes(dst));
    return 0;
}

static int cmd_get_rows(char ** a) {
    const ggml_type t = type_of(a[0]), td = type_of(a[1]);
    const int64_t ne00 = atoll(a[2]), n_rows = atoll(a[3]);
    host_ctx h(4*(size_t) ne00*n_rows*sizeof(float) + 1024*1024);
    ggml_tensor * src = ggml_new_tensor_2d(h.ctx, t, ne00, n_rows);
    ggml_tensor * ids = ggml_new_tensor_1d(h.ctx, GGML_TYPE_I32, n_rows);
    ggml_tensor * dst = ggml_new_tensor_2d(h.ctx, td, ne00, n_rows);
    fill(src, read_all(a[5]));
    for (int64_t i = 0; i < n_rows; ++i) {
        ((int32_t *) ids->data)[i] = (int32_t) (n_rows - 1 - i);
    }
    ggml_tensor * op = ggml_get_rows(h.ctx, src, ids);
    op->type = td;   // ggml_get_rows makes F32 rows; the backend's GET_ROWS also writes F16/BF16
    claimed(op);
    if (!ggml_rq_cuda_get_rows(src->data, t, (const int32_t *) ids->data, dst->data, td, ne00, src->nb[1], src->nb[2],
                               src->nb[3], n_rows, 1, 1, ids->nb[0], ids->nb[1], ids->nb[2], dst->nb[1], dst->nb[2],
                               dst->nb[3], nullptr)) {
        fprintf(stderr, "get_rows: not taken\n");
        return 1;
    }
    write_out(a[6], dst->data, ggml_nbytes(dst));
    return 0;
}

// the contiguous dequantiser, or its _nc twin over rows s01 blocks apart; false when the type has none
template <typename T>
static bool run_to(to_t_cuda_t<T> f, to_t_nc_cuda_t<T> f_nc, bool nc, const ggml_tensor * src, ggml_tensor * dst, int64_t s01) {
    const int64_t ne00 = src->ne[0], n_rows = src->ne[1];
    if (nc && f_nc) {
        f_nc(src->data, (T *) dst->data, ne00, n_rows, 1, 1, s01, s01*n_rows, s01*n_rows, nullptr);
    } else if (!nc && f) {
        f(src->data, (T *) dst->data, ne00*n_rows, nullptr);
    } else {
        return false;
    }
    return true;
}

static int cmd_to(char ** a, bool nc) {
    const ggml_type t = type_of(a[0]), td = type_of(a[1]);
    const int64_t ne00 = atoll(a[2]), n_rows = atoll(a[3]);
    host_ctx h(4*(size_t) ne00*n_rows*sizeof(float) + 1024*1024);
    ggml_tensor * src = nc ? strided_rows(h.ctx, t, ne00, n_rows) : ggml_new_tensor_2d(h.ctx, t, ne00, n_rows);
    ggml_tensor * dst = ggml_new_tensor_2d(h.ctx, td, ne00, n_rows);
    copy_in_rows(src, read_all(a[5]));
    const int64_t s01 = (int64_t) (src->nb[1]/ggml_type_size(t));
    bool ok = false;
    switch (td) {
        case GGML_TYPE_F32:  ok = run_to(ggml_rq_get_to_fp32_cuda(t), ggml_rq_get_to_fp32_nc_cuda(t), nc, src, dst, s01); break;
        case GGML_TYPE_F16:  ok = run_to(ggml_rq_get_to_fp16_cuda(t), ggml_rq_get_to_fp16_nc_cuda(t), nc, src, dst, s01); break;
        case GGML_TYPE_BF16: ok = run_to(ggml_rq_get_to_bf16_cuda(t), ggml_rq_get_to_bf16_nc_cuda(t), nc, src, dst, s01); break;
        default: break;
    }
    if (!ok) {
        fprintf(stderr, "to: no dequantiser for %s -> %s\n", a[0], a[1]);
        return 1;
    }
    write_out(a[6], dst->data, ggml_nbytes(dst));
    return 0;
}

static int cmd_mmvq(char ** a) {
    const int64_t ne00 = atoll(a[0]), n_rows = atoll(a[1]), n_cols = atoll(a[2]), n_ch = atoll(a[3]);
    host_ctx h(8*(size_t) ne00*(n_rows + n_cols*n_ch)*sizeof(float) + 1024*1024);
    ggml_tensor * w = ggml_new_tensor_2d(h.ctx, GGML_TYPE_ITQ3_S, ne00, n_rows);
    ggml_tensor * x = ggml_new_tensor_3d(h.ctx, GGML_TYPE_F32, ne00, n_cols, n_ch);
    fill(w, read_all(a[5]));
    fill(x, read_all(a[6]));
    ggml_tensor * dst = ggml_mul_mat(h.ctx, w, x);
    claimed(dst);
    ggml_backend_cuda_context cctx;
    ggml_rq_cuda_mul_mat_vec_itq3_s(cctx, w, x, nullptr, dst);
    write_out(a[7], dst->data, ggml_nbytes(dst));
    return 0;
}

static int cmd_mmvq_id(char ** a) {
    const int64_t ne00 = atoll(a[0]), n_rows = atoll(a[1]), n_exp = atoll(a[2]), n_used = atoll(a[3]);
    const int64_t n_xrow = atoll(a[4]), n_tok = atoll(a[5]);
    host_ctx h(8*(size_t) ne00*(n_rows*n_exp + n_xrow*n_tok)*sizeof(float) + 1024*1024);
    ggml_tensor * w   = ggml_new_tensor_3d(h.ctx, GGML_TYPE_ITQ3_S, ne00, n_rows, n_exp);
    ggml_tensor * x   = ggml_new_tensor_3d(h.ctx, GGML_TYPE_F32, ne00, n_xrow, n_tok);
    ggml_tensor * ids = ggml_new_tensor_2d(h.ctx, GGML_TYPE_I32, n_used, n_tok);
    fill(w, read_all(a[7]));
    fill(x, read_all(a[8]));
    fill(ids, read_all(a[9]));
    ggml_tensor * dst = ggml_mul_mat_id(h.ctx, w, x, ids);
    claimed(dst);
    ggml_backend_cuda_context cctx;
    ggml_rq_cuda_mul_mat_vec_itq3_s(cctx, w, x, ids, dst);
    write_out(a[10], dst->data, ggml_nbytes(dst));
    return 0;
}

static int cmd_fa(char ** a) {
    const ggml_type tk = type_of(a[0]), tv = type_of(a[1]);
    const int64_t D = atoll(a[2]), n_q = atoll(a[3]), n_head = atoll(a[4]), n_head_kv = atoll(a[5]);
    const int64_t n_kv = atoll(a[6]), n_seq = atoll(a[7]);
    const float scale = (float) atof(a[8]), softcap = (float) atof(a[9]), max_bias = (float) atof(a[10]);
    rq_cuda::n_sm = atoi(a[11]);
    const std::string mask_f = a[16], sinks_f = a[17];
    host_ctx h(4*(size_t) D*(n_q*n_head + 2*n_kv*n_head_kv)*n_seq*sizeof(float) + 2*(size_t) n_kv*n_q + 4*1024*1024);
    ggml_tensor * q = ggml_new_tensor_4d(h.ctx, GGML_TYPE_F32, D, n_q, n_head, n_seq);
    ggml_tensor * k = ggml_new_tensor_4d(h.ctx, tk, D, n_kv, n_head_kv, n_seq);
    ggml_tensor * v = ggml_new_tensor_4d(h.ctx, tv, D, n_kv, n_head_kv, n_seq);
    fill(q, read_all(a[13]));
    fill(k, read_all(a[14]));
    fill(v, read_all(a[15]));
    ggml_tensor * mask = nullptr;
    if (mask_f != "-") {
        mask = ggml_new_tensor_2d(h.ctx, GGML_TYPE_F16, n_kv, n_q);
        fill(mask, read_all(mask_f.c_str()));
    }
    ggml_tensor * dst = ggml_flash_attn_ext(h.ctx, q, k, v, mask, scale, max_bias, softcap);
    if (sinks_f != "-") {
        ggml_tensor * sinks = ggml_new_tensor_1d(h.ctx, GGML_TYPE_F32, n_head);
        fill(sinks, read_all(sinks_f.c_str()));
        ggml_flash_attn_ext_add_sinks(dst, sinks);
    }
    if (!ggml_rq_cuda_fattn_supported(0, dst)) {
        fprintf(stderr, "fa: ggml_rq_cuda_fattn_supported says no\n");
        return 1;
    }
    ggml_backend_cuda_context cctx;
    ggml_rq_cuda_flash_attn_ext(cctx, dst);
    write_out(a[18], dst->data, ggml_nbytes(dst));
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: see the head of tests/cuda/run_cuda.cpp\n");
        return 2;
    }
    const std::string cmd = argv[1];
    struct { const char * name; int nargs; int order_at; } cmds[] = {
        { "set_rows", 8, 5 }, { "cpy", 7, 4 }, { "get_rows", 7, 4 }, { "to", 7, 4 }, { "to_nc", 7, 4 },
        { "mmvq", 8, 4 }, { "mmvq_id", 11, 6 }, { "fa", 19, 12 },
    };
    for (const auto & c : cmds) {
        if (cmd != c.name) {
            continue;
        }
        if (argc != 2 + c.nargs) {
            fprintf(stderr, "%s takes %d arguments (see tests/cuda/run_cuda.cpp)\n", c.name, c.nargs);
            return 2;
        }
        char ** a = argv + 2;
        rq_cuda::order = atoi(a[c.order_at]);
        int rc = 2;
        if (cmd == "set_rows")      rc = cmd_set_rows(a);
        else if (cmd == "cpy")      rc = cmd_cpy(a);
        else if (cmd == "get_rows") rc = cmd_get_rows(a);
        else if (cmd == "to")       rc = cmd_to(a, false);
        else if (cmd == "to_nc")    rc = cmd_to(a, true);
        else if (cmd == "mmvq")     rc = cmd_mmvq(a);
        else if (cmd == "mmvq_id")  rc = cmd_mmvq_id(a);
        else if (cmd == "fa")       rc = cmd_fa(a);
        report();
        return rc;
    }
    fprintf(stderr, "unknown command %s\n", cmd.c_str());
    return 2;
}
