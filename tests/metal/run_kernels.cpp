// Runs our Metal kernels (ggml-patches/src/metal/*.metal, unchanged) on the CPU through the emulation in
// shim/metal_stdlib. Driven by tests/metal/test_metal.py, which makes the inputs with ggml's C reference and
// compares the outputs.
//
//   run_kernels get_rows TYPE N_ROWS NE00 ORDER IN OUT
//     IN: N_ROWS rows of TYPE blocks; rows are gathered in reverse order (ids N_ROWS-1 .. 0), so OUT row i is the
//     F32 dequantisation of IN row N_ROWS-1-i. ORDER: 0 runs each threadgroup's lanes forward, 1 in reverse.
//   run_kernels set_rows TYPE N_ROWS NE00 ORDER IN OUT
//     IN: N_ROWS F32 rows, written to rows N_ROWS-1 .. 0 of OUT (I64 row ids), packed as TYPE.
//   run_kernels cpy SRC DST N_ROWS NE00 ORDER IN OUT
//     CPY f32 -> TYPE or TYPE -> f32/f16 of N_ROWS rows; the source rows sit 64 bytes apart (a strided view).
//   run_kernels get_rows itq3_s ... as above;  run_kernels mul_mv|mul_mm N_ROWS NE00 N_COLS ORDER W X OUT
//     W: N_ROWS ITQ3_S rows; X: N_COLS F32 rows of NE00; OUT: F32 [N_COLS][N_ROWS] = X W^T.
//   run_kernels mul_mv_id N_ROWS NE00 N_EXPERT N_USED N_XROW N_TOK ORDER W X IDS OUT (see mul_mv_id)
//   run_kernels fa KTYPE VTYPE D N_Q N_HEAD N_HEAD_KV N_KV SCALE ORDER Q K V MASK OUT
//     ggml's FLASH_ATTN_EXT layouts: Q F32 [D, N_Q, N_HEAD], K/V packed rows [D, N_KV, N_HEAD_KV], MASK F16
//     [N_KV, N_Q]; OUT F32 [D, N_HEAD, N_Q].

#if defined(RQ_MTL_FLAT)
#include "rq.metal"          // the library source the build makes (rq-metal-flatten.cmake), as ggml-metal compiles it
#else
#include "rq-iso.metal"
#include "rq-iso-fa.metal"
#include "rq-itq3.metal"
#endif

#include "../emu/io.h"

#include <cstring>
#include <string>

#ifndef RQ_MTL_MV_CH
#define RQ_MTL_MV_CH 16   // blocks per threadgroup-memory chunk in mul_mv (as the host instantiates it)
#endif
#ifndef RQ_MTL_MM_CH
#define RQ_MTL_MM_CH 2    // ... in mul_mm
#endif

template <typename block_q, short BITS, short QK>
static void get_rows(int n_rows, int ne00, int order, const std::vector<unsigned char> & src, std::vector<float> & out) {
    const size_t row_bytes = (size_t) (ne00/QK)*sizeof(block_q);
    if (src.size() != row_bytes*n_rows) {
        fprintf(stderr, "input has %zu bytes, expected %zu\n", src.size(), row_bytes*n_rows);
        exit(2);
    }
    std::vector<int32_t> ids(n_rows);
    for (int i = 0; i < n_rows; ++i) {
        ids[i] = n_rows - 1 - i;
    }
    out.assign((size_t) n_rows*ne00, 0.0f);

    ggml_metal_kargs_get_rows args = {};
    args.ne00t = ne00;
    args.ne00  = ne00;
    args.nb01  = row_bytes;
    args.nb02  = row_bytes*n_rows;
    args.nb03  = row_bytes*n_rows;
    args.ne10  = n_rows;
    args.nb10  = sizeof(int32_t);
    args.nb11  = sizeof(int32_t)*n_rows;
    args.nb12  = sizeof(int32_t)*n_rows;
    args.nb1   = sizeof(float)*ne00;
    args.nb2   = sizeof(float)*ne00*n_rows;
    args.nb3   = sizeof(float)*ne00*n_rows;

    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) n_rows, N_SIMDWIDTH, sizeof(block_q), shmem, [&](unsigned g, unsigned tid) {
        kernel_get_rows_iso<block_q, BITS, QK>(args, src.data(), ids.data(), out.data(), shmem.data(),
                                               metal::uint3(g, 0, 0), (metal::ushort) tid);
    }, order);
}

static void get_rows_itq3(int n_rows, int ne00, int order, const std::vector<unsigned char> & src, std::vector<float> & out) {
    const size_t row_bytes = (size_t) (ne00/QK_ITQ)*sizeof(block_itq3_s);
    if (src.size() != row_bytes*n_rows) {
        fprintf(stderr, "input has %zu bytes, expected %zu\n", src.size(), row_bytes*n_rows);
        exit(2);
    }
    std::vector<int32_t> ids(n_rows);
    for (int i = 0; i < n_rows; ++i) {
        ids[i] = n_rows - 1 - i;
    }
    out.assign((size_t) n_rows*ne00, 0.0f);
    ggml_metal_kargs_get_rows args = {};
    args.ne00t = ne00; args.ne00 = ne00;
    args.nb01 = row_bytes; args.nb02 = row_bytes*n_rows; args.nb03 = args.nb02;
    args.ne10 = n_rows; args.nb10 = sizeof(int32_t); args.nb11 = sizeof(int32_t)*n_rows; args.nb12 = args.nb11;
    args.nb1 = sizeof(float)*ne00; args.nb2 = args.nb1*n_rows; args.nb3 = args.nb2;
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) n_rows, N_SIMDWIDTH, 0, shmem, [&](unsigned g, unsigned tid) {
        kernel_get_rows_itq3_s(args, src.data(), ids.data(), out.data(), metal::uint3(g, 0, 0), (metal::ushort) tid);
    }, order);
}

// MM: the matrix-matrix instance (8 columns per threadgroup, as the host instantiates it), else matrix-vector
template <bool MM>
static int mul_mv(char ** a) {
    const int n_rows = atoi(a[0]), ne00 = atoi(a[1]), n_cols = atoi(a[2]), order = atoi(a[3]);
    const std::vector<unsigned char> w = read_all(a[4]), x = read_all(a[5]);
    const size_t row_bytes = (size_t) (ne00/QK_ITQ)*sizeof(block_itq3_s);
    if (w.size() != row_bytes*n_rows || x.size() != sizeof(float)*ne00*n_cols) {
        fprintf(stderr, "mul_mv: input sizes do not match the shape\n");
        return 2;
    }
    constexpr int NSG = 4, NR = MM ? 4 : 2, NC = MM ? 8 : 1, CH = MM ? RQ_MTL_MM_CH : RQ_MTL_MV_CH;
    ggml_metal_kargs_mul_mv args = {};
    args.ne00 = ne00; args.ne01 = n_rows; args.ne02 = 1;
    args.nb00 = sizeof(block_itq3_s); args.nb01 = row_bytes; args.nb02 = row_bytes*n_rows; args.nb03 = args.nb02;
    args.ne10 = ne00; args.ne11 = n_cols; args.ne12 = 1;
    args.nb10 = sizeof(float); args.nb11 = sizeof(float)*ne00; args.nb12 = args.nb11*n_cols; args.nb13 = args.nb12;
    args.ne0 = n_rows; args.ne1 = n_cols; args.nr0 = NR; args.r2 = 1; args.r3 = 1;
    const int n_tg = (n_rows + NSG*NR - 1)/(NSG*NR), n_cg = (n_cols + NC - 1)/NC;
    std::vector<float> out((size_t) n_rows*n_cols, NAN);
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) (n_tg*n_cg), NSG*N_SIMDWIDTH, sizeof(float)*QK_ITQ*NC*std::min(CH, ne00/QK_ITQ), shmem, [&](unsigned g, unsigned tid) {
        kernel_mul_mv_itq3_s_f32<NSG, NR, NC, CH>(args, (const char *) w.data(), (const char *) x.data(), (char *) out.data(),
            (float *) shmem.data(), metal::uint3(g % n_tg, g / n_tg, 0), (metal::ushort) (tid % N_SIMDWIDTH),
            (metal::ushort) (tid / N_SIMDWIDTH));
    }, order);
    return write_all(a[6], out);
}

// MUL_MAT_ID: W holds N_EXPERT experts of N_ROWS rows; X is [N_TOK][N_XROW][NE00] (N_XROW 1: every slot reads the
// token's one row, else slot s reads row s); IDS I32 [N_TOK][N_USED]; OUT F32 [N_TOK][N_USED][N_ROWS]
static int mul_mv_id(char ** a) {
    const int n_rows = atoi(a[0]), ne00 = atoi(a[1]), n_expert = atoi(a[2]), n_used = atoi(a[3]), n_xrow = atoi(a[4]),
              n_tok = atoi(a[5]), order = atoi(a[6]);
    const std::vector<unsigned char> w = read_all(a[7]), x = read_all(a[8]), ids = read_all(a[9]);
    const size_t row_bytes = (size_t) (ne00/QK_ITQ)*sizeof(block_itq3_s);
    if (w.size() != row_bytes*n_rows*n_expert || x.size() != sizeof(float)*ne00*n_xrow*n_tok ||
        ids.size() != sizeof(int32_t)*n_used*n_tok) {
        fprintf(stderr, "mul_mv_id: input sizes do not match the shape\n");
        return 2;
    }
    constexpr int NSG = 4, NR = 2, CH = RQ_MTL_MV_CH;
    ggml_metal_kargs_mul_mv_id args = {};
    args.nei0 = n_used; args.nei1 = n_tok; args.nbi1 = sizeof(int32_t)*n_used;
    args.ne00 = ne00; args.ne01 = n_rows; args.ne02 = n_expert;
    args.nb00 = sizeof(block_itq3_s); args.nb01 = row_bytes; args.nb02 = row_bytes*n_rows;
    args.ne10 = ne00; args.ne11 = n_xrow; args.ne12 = n_tok; args.ne13 = 1;
    args.nb10 = sizeof(float); args.nb11 = sizeof(float)*ne00; args.nb12 = args.nb11*n_xrow;
    args.ne0 = n_rows; args.ne1 = n_used; args.nb1 = sizeof(float)*n_rows; args.nr0 = NR;
    const int n_tg = (n_rows + NSG*NR - 1)/(NSG*NR);
    std::vector<float> out((size_t) n_rows*n_used*n_tok, NAN);
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) (n_tg*n_used*n_tok), NSG*N_SIMDWIDTH, sizeof(float)*QK_ITQ*std::min(CH, ne00/QK_ITQ), shmem, [&](unsigned g, unsigned tid) {
        kernel_mul_mv_id_itq3_s_f32<NSG, NR, CH>(args, (const char *) w.data(), (const char *) x.data(), (char *) out.data(),
            (const char *) ids.data(), (float *) shmem.data(), metal::uint3(g % n_tg, 0, g / n_tg),
            (metal::ushort) (tid % N_SIMDWIDTH), (metal::ushort) (tid / N_SIMDWIDTH));
    }, order);
    return write_all(a[10], out);
}

template <typename block_q, short BITS, short QK>
static int cpy(const std::string & st, const std::string & dt, int n_rows, int ne00, int order,
               const std::vector<unsigned char> & in, std::vector<unsigned char> & out) {
    const bool quant = st == "f32";
    const size_t qrow = (size_t) (ne00/QK)*sizeof(block_q);
    const size_t esz  = dt == "f16" ? 2 : 4;
    const size_t srow = quant ? sizeof(float)*ne00 : qrow;
    const size_t drow = quant ? qrow : esz*ne00;
    if (in.size() != srow*n_rows) {
        fprintf(stderr, "cpy: input has %zu bytes, expected %zu\n", in.size(), srow*n_rows);
        return 2;
    }
    const size_t stride = srow + 64;
    std::vector<unsigned char> src(stride*n_rows, 0xcd);
    for (int r = 0; r < n_rows; ++r) {
        memcpy(src.data() + r*stride, in.data() + r*srow, srow);
    }
    out.assign(drow*n_rows, 0xee);
    ggml_metal_kargs_cpy args = {};
    args.nk0 = ne00/QK; args.ne00 = ne00; args.ne01 = n_rows; args.ne02 = 1; args.ne03 = 1;
    args.nb00 = quant ? sizeof(float) : sizeof(block_q); args.nb01 = stride; args.nb02 = stride*n_rows; args.nb03 = args.nb02;
    args.ne0 = ne00; args.ne1 = n_rows; args.ne2 = 1; args.ne3 = 1;
    args.nb0 = quant ? sizeof(block_q) : esz; args.nb1 = drow; args.nb2 = drow*n_rows; args.nb3 = args.nb2;
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) n_rows, N_SIMDWIDTH, sizeof(block_q), shmem, [&](unsigned g, unsigned tid) {
        const metal::uint3 tg(g, 0, 0);
        if (quant) {
            kernel_cpy_f32_iso<block_q, BITS, QK>(args, (const char *) src.data(), (char *) out.data(), tg, (metal::ushort) tid);
        } else if (esz == 2) {
            kernel_cpy_iso_t<block_q, BITS, QK, metal::half>(args, (const char *) src.data(), (char *) out.data(), shmem.data(), tg, (metal::ushort) tid);
        } else {
            kernel_cpy_iso_t<block_q, BITS, QK, float>(args, (const char *) src.data(), (char *) out.data(), shmem.data(), tg, (metal::ushort) tid);
        }
    }, order);
    return 0;
}

template <typename block_q, short BITS, short QK>
static void set_rows(int n_rows, int ne00, int order, const std::vector<unsigned char> & src, std::vector<unsigned char> & out) {
    const size_t row_bytes = (size_t) (ne00/QK)*sizeof(block_q);
    if (src.size() != sizeof(float)*ne00*n_rows) {
        fprintf(stderr, "input has %zu bytes, expected %zu\n", src.size(), sizeof(float)*ne00*n_rows);
        exit(2);
    }
    std::vector<int64_t> ids(n_rows);
    for (int i = 0; i < n_rows; ++i) {
        ids[i] = n_rows - 1 - i;
    }
    out.assign(row_bytes*n_rows, 0xee);
    ggml_metal_kargs_set_rows args = {};
    args.nk0  = ne00/QK;
    args.ne01 = n_rows;
    args.nb01 = sizeof(float)*ne00;
    args.nb02 = args.nb01*n_rows;
    args.nb03 = args.nb02;
    args.ne11 = 1;
    args.ne12 = 1;
    args.nb10 = sizeof(int64_t);
    args.nb11 = sizeof(int64_t)*n_rows;
    args.nb12 = args.nb11;
    args.nb1  = row_bytes;
    args.nb2  = row_bytes*n_rows;
    args.nb3  = args.nb2;
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) n_rows, N_SIMDWIDTH, 0, shmem, [&](unsigned g, unsigned tid) {
        kernel_set_rows_iso<int64_t, block_q, BITS, QK>(args, src.data(), ids.data(), (float *) out.data(),
                                                         metal::uint3(g, 0, 0), (metal::ushort) tid);
    }, order);
}

template <typename bk, short KB, typename bv, short VB, short D, short QK>
static int fa(char ** a, int order) {
    const int n_q = atoi(a[0]), n_head = atoi(a[1]), n_head_kv = atoi(a[2]), n_kv = atoi(a[3]);
    const float scale = (float) atof(a[4]);
    const std::vector<unsigned char> q = read_all(a[5]), k = read_all(a[6]), v = read_all(a[7]), m = read_all(a[8]);
    const size_t krow = (D/QK)*sizeof(bk), vrow = (D/QK)*sizeof(bv);
    if (q.size() != sizeof(float)*D*n_q*n_head || k.size() != krow*n_kv*n_head_kv || v.size() != vrow*n_kv*n_head_kv ||
        m.size() != sizeof(uint16_t)*n_kv*n_q) {
        fprintf(stderr, "fa: input sizes do not match the shape\n");
        return 2;
    }
    ggml_metal_kargs_flash_attn_ext_vec args = {};
    args.ne01 = n_q;  args.ne02 = n_head;  args.ne03 = 1;
    args.nb01 = sizeof(float)*D;  args.nb02 = args.nb01*n_q;  args.nb03 = args.nb02*n_head;
    args.ne11 = n_kv; args.ne_12_2 = n_head_kv; args.ne_12_3 = 1;
    args.nb11 = krow; args.nb12 = krow*n_kv; args.nb13 = args.nb12*n_head_kv;
    args.nb21 = vrow; args.nb22 = vrow*n_kv; args.nb23 = args.nb22*n_head_kv;
    args.ne31 = n_q;  args.ne32 = 1; args.ne33 = 1;
    args.nb31 = sizeof(uint16_t)*n_kv; args.nb32 = args.nb31*n_q; args.nb33 = args.nb32;
    args.ne1 = n_head; args.ne2 = n_q; args.ne3 = 1;
    args.scale = scale;
    constexpr int NSG = 4;
    std::vector<float> out((size_t) D*n_head*n_q, 0.0f);
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch((unsigned) (n_q*n_head), NSG*N_SIMDWIDTH, sizeof(float)*NSG*(2 + D), shmem, [&](unsigned g, unsigned tid) {
        kernel_flash_attn_ext_iso<bk, KB, bv, VB, D, QK, NSG, true>(args, (const char *) q.data(), (const char *) k.data(),
            (const char *) v.data(), (const char *) m.data(), (char *) out.data(), (float *) shmem.data(),
            metal::uint3(g % n_q, g / n_q, 0), (metal::ushort) (tid % N_SIMDWIDTH), (metal::ushort) (tid / N_SIMDWIDTH));
    }, order);
    return write_all(a[9], out);
}

int main(int argc, char ** argv) {
    if (argc == 16 && std::string(argv[1]) == "fa") {
        const std::string kv = std::string(argv[2]) + "/" + argv[3];
        const int d = atoi(argv[4]), order = atoi(argv[10]);
        char * a[10] = { argv[5], argv[6], argv[7], argv[8], argv[9], argv[11], argv[12], argv[13], argv[14], argv[15] };
        if (kv == "isoquant3_0/isoquant3_0" && d == 128) return fa<block_isoquant3_0, 3, block_isoquant3_0, 3, 128, QK_ISO>(a, order);
        if (kv == "isoquant4_0/isoquant3_0" && d == 128) return fa<block_isoquant4_0, 4, block_isoquant3_0, 3, 128, QK_ISO>(a, order);
        if (kv == "isoquant4_0/isoquant4_0" && d == 128) return fa<block_isoquant4_0, 4, block_isoquant4_0, 4, 128, QK_ISO>(a, order);
        if (kv == "isoquant3_0/isoquant3_0" && d == 256) return fa<block_isoquant3_0, 3, block_isoquant3_0, 3, 256, QK_ISO>(a, order);
        if (kv == "isoquant3_64/isoquant3_64" && d == 64) return fa<block_isoquant3_64, 3, block_isoquant3_64, 3, 64, QK_ISO64>(a, order);
        if (kv == "isoquant4_64/isoquant4_64" && d == 64) return fa<block_isoquant4_64, 4, block_isoquant4_64, 4, 64, QK_ISO64>(a, order);
        fprintf(stderr, "fa: no kernel for %s at head size %d\n", kv.c_str(), d);
        return 2;
    }
    if (argc == 9 && std::string(argv[1]) == "cpy") {
        const std::string st = argv[2], dt = argv[3], t = st == "f32" ? dt : st;
        const int n_rows = atoi(argv[4]), ne00 = atoi(argv[5]), order = atoi(argv[6]);
        const std::vector<unsigned char> in = read_all(argv[7]);
        std::vector<unsigned char> out;
        int rc = 2;
        if      (t == "isoquant3_0")  rc = cpy<block_isoquant3_0,  3, QK_ISO>  (st, dt, n_rows, ne00, order, in, out);
        else if (t == "isoquant4_0")  rc = cpy<block_isoquant4_0,  4, QK_ISO>  (st, dt, n_rows, ne00, order, in, out);
        else if (t == "isoquant3_64") rc = cpy<block_isoquant3_64, 3, QK_ISO64>(st, dt, n_rows, ne00, order, in, out);
        else if (t == "isoquant4_64") rc = cpy<block_isoquant4_64, 4, QK_ISO64>(st, dt, n_rows, ne00, order, in, out);
        else fprintf(stderr, "cpy: unknown type %s\n", t.c_str());
        if (rc != 0) {
            return rc;
        }
        return write_all(argv[8], out);
    }
    if (argc == 9 && std::string(argv[1]) == "mul_mv") {
        return mul_mv<false>(argv + 2);
    }
    if (argc == 9 && std::string(argv[1]) == "mul_mm") {
        return mul_mv<true>(argv + 2);
    }
    if (argc == 13 && std::string(argv[1]) == "mul_mv_id") {
        return mul_mv_id(argv + 2);
    }
    if (argc == 8 && std::string(argv[1]) == "set_rows") {
        const std::string type = argv[2];
        const int n_rows = atoi(argv[3]), ne00 = atoi(argv[4]), order = atoi(argv[5]);
        const std::vector<unsigned char> src = read_all(argv[6]);
        std::vector<unsigned char> out;
        if (type == "isoquant3_0") {
            set_rows<block_isoquant3_0, 3, QK_ISO>(n_rows, ne00, order, src, out);
        } else if (type == "isoquant4_0") {
            set_rows<block_isoquant4_0, 4, QK_ISO>(n_rows, ne00, order, src, out);
        } else if (type == "isoquant3_64") {
            set_rows<block_isoquant3_64, 3, QK_ISO64>(n_rows, ne00, order, src, out);
        } else if (type == "isoquant4_64") {
            set_rows<block_isoquant4_64, 4, QK_ISO64>(n_rows, ne00, order, src, out);
        } else {
            fprintf(stderr, "unknown type %s\n", type.c_str());
            return 2;
        }
        return write_all(argv[7], out);
    }
    if (argc != 8 || std::string(argv[1]) != "get_rows") {
        fprintf(stderr, "usage: %s get_rows TYPE N_ROWS NE00 ORDER IN OUT\n"
                        "       %s fa KTYPE VTYPE D N_Q N_HEAD N_HEAD_KV N_KV SCALE ORDER Q K V MASK OUT\n", argv[0], argv[0]);
        return 2;
    }
    const std::string type = argv[2];
    const int n_rows = atoi(argv[3]), ne00 = atoi(argv[4]), order = atoi(argv[5]);
    const std::vector<unsigned char> src = read_all(argv[6]);
    std::vector<float> out;
    if (type == "isoquant3_0") {
        get_rows<block_isoquant3_0, 3, QK_ISO>(n_rows, ne00, order, src, out);
    } else if (type == "isoquant4_0") {
        get_rows<block_isoquant4_0, 4, QK_ISO>(n_rows, ne00, order, src, out);
    } else if (type == "isoquant3_64") {
        get_rows<block_isoquant3_64, 3, QK_ISO64>(n_rows, ne00, order, src, out);
    } else if (type == "isoquant4_64") {
        get_rows<block_isoquant4_64, 4, QK_ISO64>(n_rows, ne00, order, src, out);
    } else if (type == "itq3_s") {
        get_rows_itq3(n_rows, ne00, order, src, out);
    } else {
        fprintf(stderr, "unknown type %s\n", type.c_str());
        return 2;
    }
    return write_all(argv[7], out);
}
