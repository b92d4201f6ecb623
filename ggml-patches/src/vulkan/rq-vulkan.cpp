// RotaryQuant on ggml-vulkan: supports_op, the dispatch of the fused IsoQuant flash attention and of the ITQ3_S
// matrix-vector kernel, and the counters. The shaders are compiled by rq-vulkan.cmake; the quantise and dequantise
// pipelines sit in upstream's per-type tables (rq-vulkan-shaders.h), so upstream's code dispatches them.

#include "rq-vulkan.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

// the fused kernel's type codes (iso_fa.comp: T_*), -1 for a type it does not read
static int rq_vk_fa_code(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F16:          return 0;
        case GGML_TYPE_Q8_0:         return 1;
        case GGML_TYPE_ISOQUANT3_0:  return 2;
        case GGML_TYPE_ISOQUANT4_0:  return 3;
        case GGML_TYPE_ISOQUANT3_64: return 4;
        case GGML_TYPE_ISOQUANT4_64: return 5;
        default:                     return -1;
    }
}

// the quantiser keeps the reference's float64 norm: devices without shaderFloat64 quantise on the CPU
static bool rq_vk_float64(const vk_device & device) {
    static std::mutex mutex;
    static std::unordered_map<VkPhysicalDevice, bool> cache;
    std::lock_guard<std::mutex> lock(mutex);
    const VkPhysicalDevice pd = device->physical_device;
    auto it = cache.find(pd);
    if (it == cache.end()) {
        it = cache.emplace(pd, device->physical_device.getFeatures().shaderFloat64 == VK_TRUE).first;
    }
    return it->second;
}

static bool rq_vk_is_ours(ggml_type t) {
    return ggml_rq_type_is_iso(t) || t == GGML_TYPE_ITQ3_S;
}

int ggml_vk_rq_supports_op(const vk_device & device, const ggml_tensor * op) {
    bool ours = rq_vk_is_ours(op->type);
    for (int i = 0; i < GGML_MAX_SRC && op->src[i]; ++i) {
        ours |= rq_vk_is_ours(op->src[i]->type);
    }
    if (!ours || ggml_op_is_empty(op->op)) {
        return -1;   // NONE, VIEW, RESHAPE, PERMUTE, TRANSPOSE: no kernel, upstream's answer
    }
    // the research variants (GGML_ISOQUANT_VARIANT, skip-inverse) exist on the CPU only
    if (ggml_rq_iso_get_variant() != GGML_RQ_ISO_V3 || ggml_rq_iso_get_skip_inverse()) {
        return 0;
    }
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    switch (op->op) {
        case GGML_OP_SET_ROWS:
            return ggml_rq_type_is_iso(op->type) && rq_vk_float64(device) &&
                   (src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16) &&
                   (src1->type == GGML_TYPE_I32 || src1->type == GGML_TYPE_I64) &&
                   src0->nb[0] == ggml_type_size(src0->type);
        case GGML_OP_CPY:
            if (src0->type == op->type) {
                return -1;   // a same-type copy moves bytes: upstream's
            }
            if (src0->type == GGML_TYPE_F32 && ggml_rq_type_is_iso(op->type)) {
                return rq_vk_float64(device) && src0->nb[0] == sizeof(float);
            }
            return ggml_rq_type_is_iso(src0->type) && (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_F16) &&
                   op->nb[0] == ggml_type_size(op->type);
        case GGML_OP_GET_ROWS:
            if (src0->type == GGML_TYPE_ITQ3_S) {
                return src1->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32;
            }
            return ggml_rq_type_is_iso(src0->type) && src1->type == GGML_TYPE_I32 &&
                   (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_F16);
        case GGML_OP_MUL_MAT:
            // ITQ3_S weights: dequantised to F16, then upstream's F16 matmul (no matrix-vector kernel yet)
            return src0->type == GGML_TYPE_ITQ3_S && ggml_is_contiguous(src0) &&
                   (src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16) && op->type == GGML_TYPE_F32;
        case GGML_OP_FLASH_ATTN_EXT: {
            const ggml_tensor * k = op->src[1];
            const ggml_tensor * v = op->src[2];
            const ggml_tensor * mask  = op->src[3];
            const ggml_tensor * sinks = op->src[4];
            if (op->src[5]) {
                return 0;   // exact F16 rows (the recent window): the CPU kernel only
            }
            const int kc = rq_vk_fa_code(k->type), vc = rq_vk_fa_code(v->type);
            const int64_t kqk = ggml_blck_size(k->type), vqk = ggml_blck_size(v->type);
            return kc >= 0 && vc >= 0 && src0->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
                   k->ne[0] <= 256 && v->ne[0] <= 256 && k->ne[0] % kqk == 0 && v->ne[0] % vqk == 0 &&
                   src0->nb[0] == sizeof(float) && k->nb[0] == ggml_type_size(k->type) &&
                   v->nb[0] == ggml_type_size(v->type) && k->nb[1] % 2 == 0 && v->nb[1] % 2 == 0 &&
                   (!mask || mask->type == GGML_TYPE_F16) && (!sinks || sinks->type == GGML_TYPE_F32) &&
                   op->ne[1] < 65536;
        }
        default:
            // MUL_MAT_ID on ITQ3_S, MUL_MAT on IsoQuant, ...: not on this device yet (the scheduler runs them on
            // the CPU, and llama.cpp keeps weights whose ops the device lacks in host memory)
            return 0;
    }
}

bool ggml_vk_rq_flash_attn(ggml_backend_vk_context * ctx, vk_context & subctx, const ggml_tensor * q, const ggml_tensor * k,
                           const ggml_tensor * v, const ggml_tensor * mask, const ggml_tensor * sinks, ggml_tensor * dst) {
    if (!ggml_rq_type_is_iso(k->type) && !ggml_rq_type_is_iso(v->type)) {
        return false;
    }
    const int kc = rq_vk_fa_code(k->type), vc = rq_vk_fa_code(v->type);
    GGML_ASSERT(kc >= 0 && vc >= 0);
    vk_pipeline & pipeline = ctx->device->pipeline_rq_fa[kc][vc];
    ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);

    rq_vk_fa_push_constants pc {};
    pc.DK = (uint32_t) k->ne[0];
    pc.DV = (uint32_t) v->ne[0];
    pc.KV = (uint32_t) k->ne[1];
    pc.N  = (uint32_t) q->ne[1];
    pc.n_head = (uint32_t) q->ne[2];
    pc.nbq1 = q->nb[1]/4; pc.nbq2 = q->nb[2]/4; pc.nbq3 = q->nb[3]/4;
    pc.nbk1 = k->nb[1]/2; pc.nbk2 = k->nb[2]/2; pc.nbk3 = k->nb[3]/2;
    pc.nbv1 = v->nb[1]/2; pc.nbv2 = v->nb[2]/2; pc.nbv3 = v->nb[3]/2;
    pc.rk = (uint32_t) (q->ne[2]/k->ne[2]) | (uint32_t) (q->ne[3]/k->ne[3]) << 16;
    pc.rv = (uint32_t) (q->ne[2]/v->ne[2]) | (uint32_t) (q->ne[3]/v->ne[3]) << 16;
    if (mask) {
        pc.nem23 = (uint32_t) mask->ne[2] | (uint32_t) mask->ne[3] << 16;
        pc.nbm1 = mask->nb[1]/2; pc.nbm2 = mask->nb[2]/2; pc.nbm3 = mask->nb[3]/2;
    } else {
        pc.nem23 = 1 | 1 << 16;
    }
    memcpy(&pc.scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&pc.max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&pc.softcap,  (const float *) dst->op_params + 2, sizeof(float));
    pc.flags = (mask ? 1u : 0u) | (sinks ? 2u : 0u);

    vk_subbuffer q_buf = ggml_vk_tensor_subbuffer(ctx, q, true);
    vk_subbuffer k_buf = ggml_vk_tensor_subbuffer(ctx, k, true);
    vk_subbuffer v_buf = ggml_vk_tensor_subbuffer(ctx, v, true);
    vk_subbuffer d_buf = ggml_vk_tensor_subbuffer(ctx, dst, true);
    vk_subbuffer m_buf = mask  ? ggml_vk_tensor_subbuffer(ctx, mask, true)  : q_buf;
    vk_subbuffer s_buf = sinks ? ggml_vk_tensor_subbuffer(ctx, sinks, true) : q_buf;
    pc.offq = get_misalign_bytes(ctx, q)/4;
    pc.offk = get_misalign_bytes(ctx, k)/2;
    pc.offv = get_misalign_bytes(ctx, v)/2;
    pc.offd = get_misalign_bytes(ctx, dst)/4;
    pc.offm = mask  ? get_misalign_bytes(ctx, mask)/2  : 0;
    pc.offs = sinks ? get_misalign_bytes(ctx, sinks)/4 : 0;

    ggml_vk_dispatch_pipeline(ctx, subctx, pipeline, { q_buf, k_buf, v_buf, m_buf, s_buf, d_buf }, pc,
                              { (uint32_t) q->ne[1], (uint32_t) q->ne[2], (uint32_t) q->ne[3] });
    return true;
}

bool ggml_vk_rq_mul_mat_vec_itq3(ggml_backend_vk_context * ctx, vk_context & subctx, const ggml_tensor * src0,
                                 const ggml_tensor * src1, ggml_tensor * dst) {
    // itq3_mul_mat_vec.comp: up to 8 columns of a 2-D product with rows in place; anything else dequantises first
    if (src0->type != GGML_TYPE_ITQ3_S || src1->type != GGML_TYPE_F32 || dst->ne[1] > 8 ||
        src0->ne[2] != 1 || src0->ne[3] != 1 || src1->ne[2] != 1 || src1->ne[3] != 1 ||
        src1->nb[0] != sizeof(float) || dst->nb[0] != sizeof(float) || src0->nb[0] != ggml_type_size(src0->type)) {
        return false;
    }
    vk_pipeline & pipeline = ctx->device->pipeline_rq_itq3_mmv;
    ggml_pipeline_request_descriptor_sets(ctx, pipeline, 1);
    const rq_vk_itq3_mmv_push_constants pc = {
        (uint32_t) src0->ne[0], (uint32_t) src0->ne[1], (uint32_t) src1->ne[1],
        (uint32_t) (src0->nb[1]/ggml_type_size(src0->type)), (uint32_t) (src1->nb[1]/sizeof(float)),
        (uint32_t) (dst->nb[1]/sizeof(float)),
        get_misalign_bytes(ctx, src0)/(uint32_t) ggml_type_size(src0->type), get_misalign_bytes(ctx, src1)/4,
        get_misalign_bytes(ctx, dst)/4,
    };
    ggml_vk_dispatch_pipeline(ctx, subctx, pipeline,
                              { ggml_vk_tensor_subbuffer(ctx, src0, true), ggml_vk_tensor_subbuffer(ctx, src1, true),
                                ggml_vk_tensor_subbuffer(ctx, dst, true) }, pc, { (uint32_t) src0->ne[1], 1, 1 });
    return true;
}

// FLASH_ATTN_EXT nodes with IsoQuant K/V that the Vulkan backend recorded (for tests and gpu-check: the process-wide
// iso_fused_calls also counts the CPU's)
static std::atomic<uint64_t> rq_vk_fused_calls { 0 };

uint64_t ggml_rq_vk_fused_calls(void) {
    return rq_vk_fused_calls.load(std::memory_order_relaxed);
}

void ggml_vk_rq_count(const ggml_tensor * node) {
    const ggml_tensor * src0 = node->src[0];
    switch (node->op) {
        case GGML_OP_FLASH_ATTN_EXT:
            if (ggml_rq_type_is_iso(node->src[1]->type) || ggml_rq_type_is_iso(node->src[2]->type)) {
                ggml_rq_counter_add(GGML_RQ_ISO_FUSED_CALLS, 1);
                rq_vk_fused_calls.fetch_add(1, std::memory_order_relaxed);
            }
            break;
        case GGML_OP_GET_ROWS:
        case GGML_OP_CPY:
            if (ggml_rq_type_is_iso(src0->type)) {
                ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, ggml_nelements(node)/ggml_blck_size(src0->type));
            } else if (ggml_rq_type_is_iso(node->type)) {
                ggml_rq_counter_add(GGML_RQ_ISO_QUANT_ROWS, ggml_nelements(node)/ggml_blck_size(node->type));
            }
            break;
        case GGML_OP_SET_ROWS:
            if (ggml_rq_type_is_iso(node->type)) {
                ggml_rq_counter_add(GGML_RQ_ISO_QUANT_ROWS, ggml_nelements(src0)/ggml_blck_size(node->type));
            }
            break;
        default:
            break;
    }
}

