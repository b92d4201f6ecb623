#pragma once

// RotaryQuant on ggml-vulkan: the IsoQuant KV-cache types (quantise, dequantise, fused flash attention) and ITQ3_S
// weights (GET_ROWS, MUL_MAT).
// Included by ggml-vulkan.cpp through rq-vulkan-shaders.h (the hooks are guarded by GGML_RQ_VULKAN, which only
// ggml-rq/vulkan/rq-vulkan.cmake defines) and by rq-vulkan.cpp.

#include "ggml-vulkan-common.h"
#include "ggml-rq.h"

// the fused flash-attention pipelines: [K type][V type] in rq_vk_fa_code's order
#define RQ_VK_FA_TYPES 6

// iso_fa.comp's push constants (strides in the element units of each buffer: floats, or 16-bit words for K, V, mask)
struct rq_vk_fa_push_constants {
    uint32_t DK, DV, KV, N, n_head;
    uint32_t nbq1, nbq2, nbq3;
    uint32_t nbk1, nbk2, nbk3;
    uint32_t nbv1, nbv2, nbv3;
    uint32_t rk, rv;            // GQA ratios: dim 2 | dim 3 << 16
    uint32_t nem23;             // mask broadcast: ne2 | ne3 << 16
    uint32_t nbm1, nbm2, nbm3;
    float    scale, max_bias, softcap;
    uint32_t flags;
    uint32_t offq, offk, offv, offm, offs, offd;
};
static_assert(sizeof(rq_vk_fa_push_constants) <= 128, "rq_vk_fa_push_constants must fit 128 bytes");

// itq3_mul_mat_vec.comp's push constants
struct rq_vk_itq3_mmv_push_constants {
    uint32_t K, M, N, nb01, nb11, nb1, offa, offb, offd;
};

// 1/0: whether the device runs `op`, which touches ISOQUANT* or ITQ3_S; -1: not one of ours (upstream decides)
int ggml_vk_rq_supports_op(const vk_device & device, const ggml_tensor * op);

// FLASH_ATTN_EXT with IsoQuant K or V: records the fused kernel and returns true; false for other types
bool ggml_vk_rq_flash_attn(ggml_backend_vk_context * ctx, vk_context & subctx, const ggml_tensor * q, const ggml_tensor * k,
                           const ggml_tensor * v, const ggml_tensor * mask, const ggml_tensor * sinks, ggml_tensor * dst);

// MUL_MAT of ITQ3_S weights by up to 8 F32 columns: the matrix-vector kernel on rotated activations; false when
// the product is not of that shape (the caller dequantises to F16 and runs upstream's matmul)
bool ggml_vk_rq_mul_mat_vec_itq3(ggml_backend_vk_context * ctx, vk_context & subctx, const ggml_tensor * src0,
                                 const ggml_tensor * src1, ggml_tensor * dst);

// counts, as the CPU backend does, what a recorded node does with IsoQuant data (ggml-rq.h counters)
void ggml_vk_rq_count(const ggml_tensor * node);

// FLASH_ATTN_EXT nodes with IsoQuant K or V recorded by this backend (tests, gpu-check: iso_fused_calls counts the
// CPU's too)
extern "C" {
GGML_BACKEND_API uint64_t ggml_rq_vk_fused_calls(void);
}
