#version 450

// Quantise rows to an IsoQuant type: SET_ROWS (the KV-cache write; -DSET_ROWS, index type B_TYPE; -DA_F16 for
// an F16 source) and CPY F32 -> ISO. One invocation per block, on the grid and indexing of upstream's
// copy_to_quant.comp, so that ggml_vk_op_f32 dispatches it unchanged. Needs shaderFloat64 (the float64 norm).

#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#define ISO_QUANTIZE
#include "rq-iso.glsl"

layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;

#if defined(A_F16)
#define A_TYPE uint16_t     // fp16 bits: 16-bit storage only, no fp16 arithmetic needed
#define A_LOAD(i) unpackHalf2x16(uint(data_a[i])).x
#else
#define A_TYPE float
#define A_LOAD(i) data_a[i]
#endif
#define D_TYPE block_iso

#if defined(SET_ROWS)
#include "generic_binary_head.glsl"
#if B_SIZE == 64
#define DATA_I_SWIZZLE .x
#else
#define DATA_I_SWIZZLE
#endif
#else
#include "generic_unary_head.glsl"
#endif

void main() {
#if defined(SET_ROWS)
    const uint idx = ((gl_WorkGroupID.z * 262144 + gl_WorkGroupID.y * 512 + gl_WorkGroupID.x) * 32 + gl_LocalInvocationID.x) * QK;
    if (idx >= p.ne) {
        return;
    }
    uint i00, i01, i02, i03;
    get_indices(idx, i00, i01, i02, i03);
    const uint i12 = fastmod(i03, p.ne12);
    const uint i11 = fastmod(i02, p.ne11);
    const uint i1  = data_b[src1_idx(i01, i11, i12, 0) + get_boffset()] DATA_I_SWIZZLE;
    const uint src = src0_idx(i00, i01, i02, i03) + get_aoffset();
    const uint dst = dst_idx(i00 / QK, i1, i02, i03) + get_doffset();
#else
    const uint idx = (gl_WorkGroupID.z * 262144 + gl_WorkGroupID.y * 512 + gl_WorkGroupID.x * 32 + gl_LocalInvocationID.x) * QK;
    if (idx >= p.ne) {
        return;
    }
    const uint dst = dst_idx_quant(idx, QK) + get_doffset();
    const uint src = src0_idx(idx) + get_aoffset();
#endif
    float x[QK];
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        x[i] = A_LOAD(src + i);
    }
    // The WHT scale as a value the compiler cannot know (p.ne is a multiple of QK, never 2^32-1): lavapipe folded the
    // constant into the constant SO(4) entries that multiply it next, `precise` or not, which moved a rotated value by
    // an ulp and flipped its index wherever it lay that close to a bound (~1e-7 of values; test-rq-vulkan's sweep).
    const float wht_scale = uintBitsToFloat(floatBitsToUint(ISO_WHT_SCALE) | uint(p.ne == 0xffffffffu));
    data_d[dst] = iso_quantize(x, wht_scale);
}
