#version 450

// ITQ3_S x F32 for small batches (decode): the activations are rotated like the weights (signs, FWHT-256), so each
// weight is read as its 3-bit code and never inverse-transformed: y = sum_blocks d*<grid[q], x_rot> + m*sum(x_rot).
// One workgroup of WG invocations owns WG rows and all N (<= 8) columns; per 256-block the columns' activations are
// rotated once in shared memory, then each invocation scores its row. Floats throughout (the CPU's vec_dot rounds
// the activations to 7-bit codes first, Q8_ITQ).

#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require

#include "itq3-tables.glsl"    // generated from ../itq3-tables.h by rq-vulkan.cmake

#define QK 256
#define WG 64
#define NMAX 8

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

struct block_itq3_s {
    uint16_t d;
    uint16_t m;
    uint16_t qs[QK/8];
    uint16_t qh[QK/16];
};

layout(push_constant) uniform parameter {
    uint K; uint M; uint N;
    uint nb01;          // blocks between weight rows
    uint nb11;          // floats between activation columns
    uint nb1;           // floats between output columns
    uint offa; uint offb; uint offd;   // misalignments (blocks, floats, floats)
} p;

layout(binding = 0) readonly  buffer A {block_itq3_s data_a[];};
layout(binding = 1) readonly  buffer B {float data_b[];};
layout(binding = 2) writeonly buffer D {float data_d[];};

shared float sh_x[NMAX][QK];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint row = gl_WorkGroupID.x*WG + tid;
    float acc[NMAX];
    [[unroll]] for (uint n = 0; n < NMAX; ++n) {
        acc[n] = 0.0;
    }
    for (uint b = 0; b < p.K/QK; ++b) {
        // rotate block b of every column: t = FWHT256(S x) (ggml_rq_itq3_rotate)
        for (uint n = 0; n < p.N; ++n) {
            for (uint i = tid; i < QK; i += WG) {
                sh_x[n][i] = data_b[p.offb + n*p.nb11 + b*QK + i]*itq3_signs[i];
            }
        }
        barrier();
        for (uint h = 1; h < QK; h <<= 1) {
            for (uint n = 0; n < p.N; ++n) {
                for (uint k = tid; k < QK/2; k += WG) {
                    const uint j = (k/h)*2*h + (k % h);
                    const float a = sh_x[n][j], c = sh_x[n][j + h];
                    sh_x[n][j] = a + c;
                    sh_x[n][j + h] = a - c;
                }
            }
            barrier();
        }
        if (row < p.M) {
            const block_itq3_s blk = data_a[p.offa + row*p.nb01 + b];
            const float d = unpackHalf2x16(uint(blk.d)).x*0.0625;   // the FWHT's 1/16, applied once
            const float m = unpackHalf2x16(uint(blk.m)).x*0.0625;
            for (uint n = 0; n < p.N; ++n) {
                float sg = 0.0, sx = 0.0;
                for (uint i = 0; i < QK; ++i) {
                    const uint lo = (uint(blk.qs[(i & 63u) >> 1]) >> (8*(i & 1u) + 2*(i >> 6))) & 3u;
                    const uint hi = (uint(blk.qh[(i & 31u) >> 1]) >> (8*(i & 1u) + (i >> 5))) & 1u;
                    const float x = sh_x[n][i];
                    sg += float(itq3_grid[lo | (hi << 2)])*x;
                    sx += x;
                }
                acc[n] += d*sg + m*sx;
            }
        }
        barrier();
    }
    if (row < p.M) {
        for (uint n = 0; n < p.N; ++n) {
            data_d[p.offd + n*p.nb1 + row] = acc[n];
        }
    }
}
