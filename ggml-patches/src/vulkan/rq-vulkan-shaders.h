#pragma once

// The RotaryQuant pipelines of a Vulkan device. Included once, by ggml-vulkan.cpp, whose ggml_vk_load_shaders
// calls ggml_vk_rq_load_shaders with its pipeline-creating lambda: the quantise/dequantise pipelines go into
// upstream's per-type tables (so upstream's SET_ROWS/CPY/GET_ROWS code dispatches them), the fused flash
// attention into pipeline_rq_fa. Pipelines are compiled on first use, as upstream's.

#include "rq-vulkan.h"
#include "rq-vulkan-spv.h"

template <typename Create>
static void ggml_vk_rq_load_shaders(vk_device & device, const Create & create) {
#define RQ_VK_SPV(name) sizeof(rq_spv_##name), rq_spv_##name
#define RQ_VK_ISO(T, name, QK)                                                                                           \
    create(device, device->pipeline_set_rows_i32[0][T], "set_rows_f32_" #name "_i32", RQ_VK_SPV(set_rows_f32_##name##_i32), \
           "main", 3, sizeof(vk_op_binary_push_constants), {1, 1, 1}, {1}, 1, true);                                      \
    create(device, device->pipeline_set_rows_i64[0][T], "set_rows_f32_" #name "_i64", RQ_VK_SPV(set_rows_f32_##name##_i64), \
           "main", 3, sizeof(vk_op_binary_push_constants), {1, 1, 1}, {1}, 1, true);                                      \
    create(device, device->pipeline_set_rows_i32[1][T], "set_rows_f16_" #name "_i32", RQ_VK_SPV(set_rows_f16_##name##_i32), \
           "main", 3, sizeof(vk_op_binary_push_constants), {1, 1, 1}, {1}, 1, true);                                      \
    create(device, device->pipeline_set_rows_i64[1][T], "set_rows_f16_" #name "_i64", RQ_VK_SPV(set_rows_f16_##name##_i64), \
           "main", 3, sizeof(vk_op_binary_push_constants), {1, 1, 1}, {1}, 1, true);                                      \
    create(device, device->pipeline_cpy_f32_quant[T], "cpy_f32_" #name, RQ_VK_SPV(cpy_f32_##name),                        \
           "main", 2, sizeof(vk_op_unary_push_constants), {32, 1, 1}, {}, 1);                                             \
    create(device, device->pipeline_cpy_quant_f32[T], "cpy_" #name "_f32", RQ_VK_SPV(cpy_##name##_f32),                   \
           "main", 2, sizeof(vk_op_unary_push_constants), {QK, 1, 1}, {}, 1);                                             \
    create(device, device->pipeline_cpy_quant_f16[T], "cpy_" #name "_f16", RQ_VK_SPV(cpy_##name##_f16),                   \
           "main", 2, sizeof(vk_op_unary_push_constants), {QK, 1, 1}, {}, 1);                                             \
    create(device, device->pipeline_get_rows_f32[T], "get_rows_" #name "_f32", RQ_VK_SPV(get_rows_##name##_f32),          \
           "main", 3, sizeof(vk_op_binary_push_constants), {32*QK, 1, 1}, {}, 1);                                         \
    create(device, device->pipeline_get_rows[T], "get_rows_" #name "_f16", RQ_VK_SPV(get_rows_##name##_f16),              \
           "main", 3, sizeof(vk_op_binary_push_constants), {32*QK, 1, 1}, {}, 1);

    RQ_VK_ISO(GGML_TYPE_ISOQUANT3_0,  isoquant3_0,  128)
    RQ_VK_ISO(GGML_TYPE_ISOQUANT4_0,  isoquant4_0,  128)
    RQ_VK_ISO(GGML_TYPE_ISOQUANT3_64, isoquant3_64, 64)
    RQ_VK_ISO(GGML_TYPE_ISOQUANT4_64, isoquant4_64, 64)

    // ITQ3_S: GET_ROWS, the F16 dequantisation MUL_MAT runs before upstream's F16 matmul, and the matrix-vector kernel
    create(device, device->pipeline_get_rows_f32[GGML_TYPE_ITQ3_S], "get_rows_itq3_s_f32", RQ_VK_SPV(get_rows_itq3_s_f32),
           "main", 3, sizeof(vk_op_binary_push_constants), {32*256, 1, 1}, {}, 1);
    create(device, device->pipeline_dequant[GGML_TYPE_ITQ3_S], "dequant_itq3_s", RQ_VK_SPV(dequant_itq3_s),
           "main", 2, 5 * sizeof(uint32_t), {32*256, 1, 1}, {}, 1);
    create(device, device->pipeline_rq_itq3_mmv, "mul_mat_vec_itq3_s_f32", RQ_VK_SPV(mul_mat_vec_itq3_s),
           "main", 3, sizeof(rq_vk_itq3_mmv_push_constants), {64, 1, 1}, {}, 1);

    static const char * const fa_names[RQ_VK_FA_TYPES] = { "f16", "q8_0", "iso3", "iso4", "iso3_64", "iso4_64" };
    for (uint32_t kt = 0; kt < RQ_VK_FA_TYPES; ++kt) {
        for (uint32_t vt = 0; vt < RQ_VK_FA_TYPES; ++vt) {
            if (kt < 2 && vt < 2) {
                continue; // upstream's flash attention
            }
            const std::string name = std::string("flash_attn_iso_") + fa_names[kt] + "_" + fa_names[vt];
            create(device, device->pipeline_rq_fa[kt][vt], name.c_str(), RQ_VK_SPV(flash_attn_iso), "main", 6,
                   sizeof(rq_vk_fa_push_constants), {1, 1, 1}, {kt, vt}, 1);
        }
    }
#undef RQ_VK_ISO
#undef RQ_VK_SPV
}
