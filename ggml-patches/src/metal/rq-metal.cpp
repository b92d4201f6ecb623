// RotaryQuant on ggml-metal: supports_op and the encoding of our kernels (kernels/rq.metal: rq-iso.metal,
// rq-iso-fa.metal, rq-itq3.metal). Each kernel's grid is the one its source documents; the argument structs are
// upstream's (ggml-metal-impl.h). Compiled here (tests/metal) against the pinned tree's headers; run only on a Mac
// (scripts/metal/mac-check.sh).

#include "rq-metal.h"

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-impl.h"
#include "ggml-rq.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace {

constexpr int RQ_NW     = 32;   // threads of a simdgroup (the kernels assume N_SIMDWIDTH)
constexpr int RQ_FA_NSG = 4;    // simdgroups of kernel_flash_attn_ext_iso (its instantiation)
constexpr int RQ_MV_NSG = 4;    // ... of kernel_mul_mv_itq3_s_f32 <4, 2, 1, 16> and kernel_mul_mv_id_itq3_s_f32 <4, 2, 16>
constexpr int RQ_MV_NR  = 2;
constexpr int RQ_MV_CH  = 16;
constexpr int RQ_MM_NR  = 4;    // ... of kernel_mul_mm_itq3_s_f32 = kernel_mul_mv_itq3_s_f32 <4, 4, 8, 2>
constexpr int RQ_MM_NC  = 8;
constexpr int RQ_MM_CH  = 2;

std::atomic<uint64_t> rq_metal_fused{0};

ggml_metal_buffer_id rq_buf(const ggml_tensor * t) {
    if (!t) {
        return { nullptr, 0 };
    }
    ggml_backend_buffer_t buffer = t->view_src ? t->view_src->buffer : t->buffer;
    return ggml_metal_buffer_get_id((ggml_metal_buffer_t) buffer->context, t);
}

ggml_metal_pipeline_with_params rq_pipeline(ggml_metal_library_t lib, const char * name) {
    ggml_metal_pipeline_with_params res = ggml_metal_library_get_pipeline(lib, name);
    if (!res.pipeline) {
        res = ggml_metal_library_compile_pipeline(lib, name, name, nullptr);
    }
    GGML_ASSERT(res.pipeline && "RotaryQuant Metal kernel missing from the library (kernels/rq.metal)");
    return res;
}

bool rq_is_ours(ggml_type t) {
    return ggml_rq_type_is_iso(t) || t == GGML_TYPE_ITQ3_S;
}

// the flash-attention instantiations of rq-iso-fa.metal: (K, V, head size)
bool rq_fa_instantiated(ggml_type k, ggml_type v, int64_t d) {
    switch (d) {
        case 128: return (k == GGML_TYPE_ISOQUANT3_0 && v == GGML_TYPE_ISOQUANT3_0) ||
                         (k == GGML_TYPE_ISOQUANT4_0 && v == GGML_TYPE_ISOQUANT3_0) ||
                         (k == GGML_TYPE_ISOQUANT4_0 && v == GGML_TYPE_ISOQUANT4_0);
        case 256: return k == GGML_TYPE_ISOQUANT3_0 && v == GGML_TYPE_ISOQUANT3_0;
        case 64:  return (k == GGML_TYPE_ISOQUANT3_64 && v == GGML_TYPE_ISOQUANT3_64) ||
                         (k == GGML_TYPE_ISOQUANT4_64 && v == GGML_TYPE_ISOQUANT4_64);
        default:  return false;
    }
}

void rq_encode_get_rows(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    char name[128];
    snprintf(name, sizeof(name), "kernel_get_rows_%s", ggml_type_name(src0->type));
    ggml_metal_kargs_get_rows args = {
        /*.ne00t =*/ (int32_t) src0->ne[0],
        /*.ne00  =*/ (int32_t) src0->ne[0],
        /*.nb01  =*/ src0->nb[1], /*.nb02 =*/ src0->nb[2], /*.nb03 =*/ src0->nb[3],
        /*.ne10  =*/ (int32_t) src1->ne[0],
        /*.nb10  =*/ src1->nb[0], /*.nb11 =*/ src1->nb[1], /*.nb12 =*/ src1->nb[2],
        /*.nb1   =*/ op->nb[1],   /*.nb2  =*/ op->nb[2],   /*.nb3  =*/ op->nb[3],
    };
    ggml_metal_encoder_set_pipeline(enc, rq_pipeline(lib, name));
    ggml_metal_encoder_set_bytes   (enc, &args, sizeof(args), 0);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src0), 1);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src1), 2);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(op),   3);
    if (src0->type != GGML_TYPE_ITQ3_S) {
        ggml_metal_encoder_set_threadgroup_memory_size(enc, GGML_PAD(ggml_type_size(src0->type), 16), 0); // one block
        ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) (ggml_nrows(op)*(op->ne[0]/ggml_blck_size(src0->type))));
    }
    ggml_metal_encoder_dispatch_threadgroups(enc, (int) src1->ne[0], (int) src1->ne[1], (int) src1->ne[2], RQ_NW, 1, 1);
}

void rq_encode_set_rows(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    char name[128];
    snprintf(name, sizeof(name), "kernel_set_rows_%s_%s", ggml_type_name(op->type), src1->type == GGML_TYPE_I64 ? "i64" : "i32");
    ggml_metal_kargs_set_rows args = {
        /*.nk0  =*/ (int32_t) (src0->ne[0]/ggml_blck_size(op->type)),
        /*.ne01 =*/ (int32_t) src0->ne[1],
        /*.nb01 =*/ src0->nb[1], /*.nb02 =*/ src0->nb[2], /*.nb03 =*/ src0->nb[3],
        /*.ne11 =*/ (int32_t) src1->ne[1], /*.ne12 =*/ (int32_t) src1->ne[2],
        /*.nb10 =*/ src1->nb[0], /*.nb11 =*/ src1->nb[1], /*.nb12 =*/ src1->nb[2],
        /*.nb1  =*/ op->nb[1],   /*.nb2  =*/ op->nb[2],   /*.nb3  =*/ op->nb[3],
    };
    ggml_metal_encoder_set_pipeline(enc, rq_pipeline(lib, name));
    ggml_metal_encoder_set_bytes   (enc, &args, sizeof(args), 0);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src0), 1);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src1), 2);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(op),   3);
    ggml_rq_counter_add(GGML_RQ_ISO_QUANT_ROWS, (uint64_t) (ggml_nrows(src0)*args.nk0));
    ggml_metal_encoder_dispatch_threadgroups(enc, (int) src0->ne[1], (int) src0->ne[2], (int) src0->ne[3], RQ_NW, 1, 1);
}

// CPY F32 -> IsoQuant and IsoQuant -> F32/F16, one shape on both sides (supports_op), one simdgroup per row
void rq_encode_cpy(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const bool quant = ggml_rq_type_is_iso(op->type);
    const ggml_type t = quant ? op->type : src->type;
    char name[128];
    snprintf(name, sizeof(name), "kernel_cpy_%s_%s", ggml_type_name(src->type), ggml_type_name(op->type));
    ggml_metal_kargs_cpy args = {
        /*.nk0  =*/ src->ne[0]/ggml_blck_size(t),
        /*.ne00 =*/ src->ne[0], /*.ne01 =*/ src->ne[1], /*.ne02 =*/ src->ne[2], /*.ne03 =*/ src->ne[3],
        /*.nb00 =*/ src->nb[0], /*.nb01 =*/ src->nb[1], /*.nb02 =*/ src->nb[2], /*.nb03 =*/ src->nb[3],
        /*.ne0  =*/ op->ne[0],  /*.ne1  =*/ op->ne[1],  /*.ne2  =*/ op->ne[2],  /*.ne3  =*/ op->ne[3],
        /*.nb0  =*/ op->nb[0],  /*.nb1  =*/ op->nb[1],  /*.nb2  =*/ op->nb[2],  /*.nb3  =*/ op->nb[3],
    };
    ggml_metal_encoder_set_pipeline(enc, rq_pipeline(lib, name));
    ggml_metal_encoder_set_bytes   (enc, &args, sizeof(args), 0);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src), 1);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(op),  2);
    if (!quant) {
        ggml_metal_encoder_set_threadgroup_memory_size(enc, GGML_PAD(ggml_type_size(t), 16), 0);
    }
    ggml_rq_counter_add(quant ? GGML_RQ_ISO_QUANT_ROWS : GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) (ggml_nrows(src)*args.nk0));
    ggml_metal_encoder_dispatch_threadgroups(enc, (int) src->ne[1], (int) src->ne[2], (int) src->ne[3], RQ_NW, 1, 1);
}

void rq_encode_flash_attn(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];
    float scale;
    memcpy(&scale, (const float *) op->op_params + 0, sizeof(float));
    char name[160];
    snprintf(name, sizeof(name), "kernel_flash_attn_ext_iso_%s_%s_dk%d", ggml_type_name(k->type), ggml_type_name(v->type), (int) k->ne[0]);
    ggml_metal_kargs_flash_attn_ext_vec args = {};
    args.ne01 = (int32_t) q->ne[1]; args.ne02 = (int32_t) q->ne[2]; args.ne03 = (int32_t) q->ne[3];
    args.nb01 = q->nb[1]; args.nb02 = q->nb[2]; args.nb03 = q->nb[3];
    args.ne11 = (int32_t) k->ne[1]; args.ne_12_2 = (int32_t) k->ne[2]; args.ne_12_3 = (int32_t) k->ne[3];
    args.nb11 = k->nb[1]; args.nb12 = k->nb[2]; args.nb13 = k->nb[3];
    args.nb21 = v->nb[1]; args.nb22 = v->nb[2]; args.nb23 = v->nb[3];
    args.ne31 = (int32_t) mask->ne[1]; args.ne32 = (int32_t) mask->ne[2]; args.ne33 = (int32_t) mask->ne[3];
    args.nb31 = mask->nb[1]; args.nb32 = mask->nb[2]; args.nb33 = mask->nb[3];
    args.ne1 = (int32_t) op->ne[1]; args.ne2 = (int32_t) op->ne[2]; args.ne3 = (int32_t) op->ne[3];
    args.scale = scale;
    ggml_metal_encoder_set_pipeline(enc, rq_pipeline(lib, name));
    ggml_metal_encoder_set_bytes   (enc, &args, sizeof(args), 0);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(q),    1);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(k),    2);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(v),    3);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(mask), 4);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(op),   5);
    ggml_metal_encoder_set_threadgroup_memory_size(enc, GGML_PAD(sizeof(float)*RQ_FA_NSG*(2 + k->ne[0]), 16), 0);
    ggml_rq_counter_add(GGML_RQ_ISO_FUSED_CALLS, 1);
    rq_metal_fused.fetch_add(1, std::memory_order_relaxed);
    ggml_metal_encoder_dispatch_threadgroups(enc, (int) q->ne[1], (int) q->ne[2], (int) q->ne[3], RQ_NW, RQ_FA_NSG, 1);
}

// ITQ3_S x F32: one column -> the matrix-vector kernel; more -> the same kernel over 8 columns per threadgroup
// (each row's codes decoded once for 8 columns; a column's result is the matrix-vector kernel's, bit for bit)
void rq_encode_mul_mat(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    const bool mm = src1->ne[1] > 1;
    const int nr = mm ? RQ_MM_NR : RQ_MV_NR;
    const int nc = mm ? RQ_MM_NC : 1;
    ggml_metal_kargs_mul_mv args = {
        /*.ne00 =*/ (int32_t) src0->ne[0], /*.ne01 =*/ (int32_t) src0->ne[1], /*.ne02 =*/ (int32_t) src0->ne[2],
        /*.nb00 =*/ src0->nb[0], /*.nb01 =*/ src0->nb[1], /*.nb02 =*/ src0->nb[2], /*.nb03 =*/ src0->nb[3],
        /*.ne10 =*/ (int32_t) src1->ne[0], /*.ne11 =*/ (int32_t) src1->ne[1], /*.ne12 =*/ (int32_t) src1->ne[2],
        /*.nb10 =*/ src1->nb[0], /*.nb11 =*/ src1->nb[1], /*.nb12 =*/ src1->nb[2], /*.nb13 =*/ src1->nb[3],
        /*.ne0  =*/ (int32_t) op->ne[0], /*.ne1 =*/ (int32_t) op->ne[1],
        /*.nr0  =*/ nr,
        /*.r2   =*/ (int16_t) (src1->ne[2]/src0->ne[2]), /*.r3 =*/ (int16_t) (src1->ne[3]/src0->ne[3]),
    };
    const int rows_per_tg = RQ_MV_NSG*nr;
    const int64_t chunk = std::min<int64_t>(mm ? RQ_MM_CH : RQ_MV_CH, src0->ne[0]/256);
    ggml_metal_encoder_set_pipeline(enc, rq_pipeline(lib, mm ? "kernel_mul_mm_itq3_s_f32" : "kernel_mul_mv_itq3_s_f32"));
    ggml_metal_encoder_set_bytes   (enc, &args, sizeof(args), 0);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src0), 1);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src1), 2);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(op),   3);
    ggml_metal_encoder_set_threadgroup_memory_size(enc, sizeof(float)*256*nc*chunk, 0);
    ggml_metal_encoder_dispatch_threadgroups(enc, (int) ((src0->ne[1] + rows_per_tg - 1)/rows_per_tg),
                                             (int) ((src1->ne[1] + nc - 1)/nc), (int) (src1->ne[2]*src1->ne[3]),
                                             RQ_NW, RQ_MV_NSG, 1);
}

// MUL_MAT_ID on ITQ3_S experts: upstream's mul_mv_id grid, z = (token, expert slot)
void rq_encode_mul_mat_id(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    const ggml_tensor * ids  = op->src[2];
    ggml_metal_kargs_mul_mv_id args = {
        /*.nei0 =*/ (int32_t) ids->ne[0], /*.nei1 =*/ (int32_t) ids->ne[1], /*.nbi1 =*/ ids->nb[1],
        /*.ne00 =*/ (int32_t) src0->ne[0], /*.ne01 =*/ (int32_t) src0->ne[1], /*.ne02 =*/ (int32_t) src0->ne[2],
        /*.nb00 =*/ src0->nb[0], /*.nb01 =*/ src0->nb[1], /*.nb02 =*/ src0->nb[2],
        /*.ne10 =*/ (int32_t) src1->ne[0], /*.ne11 =*/ (int32_t) src1->ne[1], /*.ne12 =*/ (int32_t) src1->ne[2],
        /*.ne13 =*/ (int32_t) src1->ne[3],
        /*.nb10 =*/ src1->nb[0], /*.nb11 =*/ src1->nb[1], /*.nb12 =*/ src1->nb[2],
        /*.ne0  =*/ (int32_t) op->ne[0], /*.ne1 =*/ (int32_t) op->ne[1], /*.nb1 =*/ op->nb[1],
        /*.nr0  =*/ RQ_MV_NR,
    };
    const int rows_per_tg = RQ_MV_NSG*RQ_MV_NR;
    const int64_t chunk = std::min<int64_t>(RQ_MV_CH, src0->ne[0]/256);
    ggml_metal_encoder_set_pipeline(enc, rq_pipeline(lib, "kernel_mul_mv_id_itq3_s_f32"));
    ggml_metal_encoder_set_bytes   (enc, &args, sizeof(args), 0);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src0), 1);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(src1), 2);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(op),   3);
    ggml_metal_encoder_set_buffer  (enc, rq_buf(ids),  4);
    ggml_metal_encoder_set_threadgroup_memory_size(enc, sizeof(float)*256*chunk, 0);
    ggml_metal_encoder_dispatch_threadgroups(enc, (int) ((src0->ne[1] + rows_per_tg - 1)/rows_per_tg), 1,
                                             (int) (ids->ne[0]*ids->ne[1]), RQ_NW, RQ_MV_NSG, 1);
}

} // namespace

uint64_t ggml_rq_metal_fused_calls(void) {
    return rq_metal_fused.load(std::memory_order_relaxed);
}

int ggml_metal_rq_supports_op(const ggml_metal_device_props * props, const ggml_tensor * op) {
    bool ours = rq_is_ours(op->type);
    for (int i = 0; i < GGML_MAX_SRC && op->src[i]; ++i) {
        ours = ours || rq_is_ours(op->src[i]->type);
    }
    if (!ours || ggml_op_is_empty(op->op)) {
        return -1;
    }
    // the research variants exist on the CPU only; every kernel reduces and shuffles within simdgroups
    if (ggml_rq_iso_get_variant() != GGML_RQ_ISO_V3 || ggml_rq_iso_get_skip_inverse() || !props->has_simdgroup_reduction) {
        return 0;
    }
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    switch (op->op) {
        case GGML_OP_GET_ROWS:
            return rq_is_ours(src0->type) && src1->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 &&
                   src0->nb[0] == ggml_type_size(src0->type) && op->ne[0] % ggml_blck_size(src0->type) == 0;
        case GGML_OP_SET_ROWS:
            return ggml_rq_type_is_iso(op->type) && src0->type == GGML_TYPE_F32 && src0->nb[0] == sizeof(float) &&
                   (src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32) &&
                   src0->ne[0] % ggml_blck_size(op->type) == 0;
        case GGML_OP_CPY: {
            // F32 -> IsoQuant (a cache write, K-shift's requantisation) or IsoQuant -> F32/F16 (the unfused path,
            // K-shift's cast): one shape, rows of whole blocks; reshaping copies stay on the CPU
            const bool quant = ggml_rq_type_is_iso(op->type) && src0->type == GGML_TYPE_F32;
            const bool deq   = ggml_rq_type_is_iso(src0->type) && (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_F16);
            const ggml_type t = quant ? op->type : src0->type;
            return (quant || deq) && ggml_are_same_shape(src0, op) && src0->ne[0] % ggml_blck_size(t) == 0 &&
                   src0->nb[0] == ggml_type_size(src0->type) && op->nb[0] == ggml_type_size(op->type);
        }
        case GGML_OP_MUL_MAT:
            return src0->type == GGML_TYPE_ITQ3_S && src1->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
                   ggml_is_contiguous(src0) && src1->nb[0] == sizeof(float) && src0->ne[0] % 256 == 0;
        case GGML_OP_MUL_MAT_ID:
            // the activation rows of a token: [ne10, 1 or n_expert_used]; ids I32 [n_expert_used, n_tokens]
            return src0->type == GGML_TYPE_ITQ3_S && src1->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
                   op->src[2]->type == GGML_TYPE_I32 && ggml_is_contiguous(src0) && src1->nb[0] == sizeof(float) &&
                   src0->ne[0] % 256 == 0 && src1->ne[3] == 1 && ggml_is_contiguous(op);
        case GGML_OP_FLASH_ATTN_EXT: {
            const ggml_tensor * k = op->src[1];
            const ggml_tensor * v = op->src[2];
            const ggml_tensor * mask = op->src[3];
            float max_bias, softcap;
            memcpy(&max_bias, (const float *) op->op_params + 1, sizeof(float));
            memcpy(&softcap,  (const float *) op->op_params + 2, sizeof(float));
            return rq_fa_instantiated(k->type, v->type, k->ne[0]) && v->ne[0] == k->ne[0] &&
                   src0->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && src0->nb[0] == sizeof(float) &&
                   mask && mask->type == GGML_TYPE_F16 && !op->src[4] && !op->src[5] && max_bias == 0.0f && softcap == 0.0f &&
                   k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type) &&
                   ggml_are_same_shape(k, v);
        }
        default:
            // DUP/CONT and reshaping copies of our types, ...: not on this device yet; the scheduler runs them on
            // the CPU
            return 0;
    }
}

bool ggml_metal_rq_encode(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_GET_ROWS:
            if (!rq_is_ours(op->src[0]->type)) return false;
            rq_encode_get_rows(lib, enc, op);
            return true;
        case GGML_OP_SET_ROWS:
            if (!ggml_rq_type_is_iso(op->type)) return false;
            rq_encode_set_rows(lib, enc, op);
            return true;
        case GGML_OP_CPY:
            if (!ggml_rq_type_is_iso(op->type) && !ggml_rq_type_is_iso(op->src[0]->type)) return false;
            rq_encode_cpy(lib, enc, op);
            return true;
        case GGML_OP_MUL_MAT:
            if (op->src[0]->type != GGML_TYPE_ITQ3_S) return false;
            rq_encode_mul_mat(lib, enc, op);
            return true;
        case GGML_OP_MUL_MAT_ID:
            if (op->src[0]->type != GGML_TYPE_ITQ3_S) return false;
            rq_encode_mul_mat_id(lib, enc, op);
            return true;
        case GGML_OP_FLASH_ATTN_EXT:
            if (!ggml_rq_type_is_iso(op->src[1]->type) && !ggml_rq_type_is_iso(op->src[2]->type)) return false;
            rq_encode_flash_attn(lib, enc, op);
            return true;
        default:
            return false;
    }
}
