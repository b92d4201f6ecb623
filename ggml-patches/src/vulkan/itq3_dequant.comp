#version 450

// Dequantise ITQ3_S blocks (256 weights): GET_ROWS -> F32 (-DGET_ROWS, the grid of get_rows_quant.comp) and the
// F16 dequantisation MUL_MAT uses before upstream's F16 matmul (the to_fp16 push constants of dequant_head.glsl).
// One invocation per block, in dequantize_row_itq3_s's operation order: w = S . FWHT256(d*grid[q] + m).

#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require

#include "itq3-tables.glsl"    // generated from ../itq3-tables.h by rq-vulkan.cmake
#include "rq-half.glsl"

#define QK 256

// d, m: fp16 bits; qs: low 2 bits of codes j, 64+j, 128+j, 192+j in byte j; qh: bit b of byte j is code 32b+j's
struct block_itq3_s {
    uint16_t d;
    uint16_t m;
    uint16_t qs[QK/8];
    uint16_t qh[QK/16];
};

#define A_TYPE block_itq3_s
#if defined(GET_ROWS)
#define B_TYPE uint
#define D_TYPE float
#include "generic_binary_head.glsl"
#else
layout (push_constant) uniform parameter { uint M; uint K; uint stride_a; uint stride_b; uint nel; } p;
layout (binding = 0) readonly buffer A {A_TYPE data_a[];};
layout (binding = 1) writeonly buffer D {uint16_t data_d[];};
#endif

layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;

uint byte_at(const uint16_t w[QK/8], uint j) { return (uint(w[j >> 1]) >> (8*(j & 1u))) & 0xffu; }

void itq3_dequantize(const block_itq3_s b, out float v[QK]) {
    const float d = unpackHalf2x16(uint(b.d)).x;
    const float m = unpackHalf2x16(uint(b.m)).x;
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        const uint lo = (byte_at(b.qs, i & 63u) >> (2*(i >> 6))) & 3u;
        const uint hi = ((uint(b.qh[(i & 31u) >> 1]) >> (8*((i & 31u) & 1u) + (i >> 5))) & 1u);
        precise float t = d*float(itq3_grid[lo | (hi << 2)]);
        precise float y = t + m;
        v[i] = y;
    }
    for (uint h = 1; h < QK; h <<= 1) {
        for (uint i = 0; i < QK; i += 2*h) {
            for (uint j = i; j < i + h; ++j) {
                const float a = v[j];
                const float c = v[j + h];
                precise float s = a + c;
                precise float t = a - c;
                v[j] = s;
                v[j + h] = t;
            }
        }
    }
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        precise float s = v[i] * 0.0625;
        v[i] = s * itq3_signs[i];
    }
}

void main() {
    float v[QK];
#if defined(GET_ROWS)
    const uint ib = gl_GlobalInvocationID.x;
    if (ib*QK >= p.ne00) {
        return;
    }
    uint gid_z = gl_GlobalInvocationID.z;
    while (gid_z < p.ne11 * p.ne12) {
        uint gid_y = gl_GlobalInvocationID.y;
        while (gid_y < p.ne10) {
            const uint i10 = gid_y;
            const uint i11 = gid_z / p.ne12;
            const uint i12 = gid_z % p.ne12;
            const uint i01 = data_b[get_boffset() + i10*p.nb10 + i11*p.nb11 + i12*p.nb12];
            itq3_dequantize(data_a[get_aoffset() + i01*p.nb01 + i11*p.nb02 + i12*p.nb03 + ib], v);
            const uint o = get_doffset() + i10*p.nb21 + i11*p.nb22 + i12*p.nb23 + ib*QK;
            [[unroll]] for (uint i = 0; i < QK; ++i) {
                data_d[o + i] = v[i];
            }
            gid_y += gl_WorkGroupSize.y * gl_NumWorkGroups.y;
        }
        gid_z += gl_WorkGroupSize.z * gl_NumWorkGroups.z;
    }
#else
    const uint ib = gl_GlobalInvocationID.x;   // blocks of a contiguous tensor, in order
    if (ib >= p.nel / QK) {
        return;
    }
    itq3_dequantize(data_a[ib], v);
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        data_d[ib*QK + i] = uint16_t(rq_half_rte(v[i]));
    }
#endif
}
