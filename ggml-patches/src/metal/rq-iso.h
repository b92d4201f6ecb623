// RotaryQuant IsoQuant on Metal, shared by the kernels (rq-iso.metal: GET_ROWS; rq-iso-fa.metal: the fused flash
// attention): the block formats and the rotation on a simdgroup. Lane l of a 128-value block holds values 4l..4l+3,
// which are SO(4) group l, so the block rotation stays in the lane and only the Walsh-Hadamard stages h >= 4 cross
// lanes (simd_shuffle_xor). The float operations and their order are the C reference's (ggml-patches/src/isoquant.c):
// d*cb[i], M u and M^T u as ((m0*u0 + m1*u1) + m2*u2) + m3*u3, butterflies (a + b, a - b), *scale, *sign.
#pragma once

#include <metal_stdlib>
#include "ggml-metal-impl.h"
#include "rq-iso-tables.h"

using namespace metal;

#ifndef N_SIMDWIDTH
#define N_SIMDWIDTH 32 // as upstream's kernels/common.h
#endif

#define QK_ISO   128
#define QK_ISO64 64

typedef struct {
    half    d;
    uint8_t qs[QK_ISO*3/8];
} block_isoquant3_0;
static_assert(sizeof(block_isoquant3_0) == 2 + QK_ISO*3/8, "wrong isoquant3_0 block size/padding");

typedef struct {
    half    d;
    uint8_t qs[QK_ISO*4/8];
} block_isoquant4_0;
static_assert(sizeof(block_isoquant4_0) == 2 + QK_ISO*4/8, "wrong isoquant4_0 block size/padding");

typedef struct {
    half    d;
    uint8_t qs[QK_ISO64*3/8];
} block_isoquant3_64;

typedef struct {
    half    d;
    uint8_t qs[QK_ISO64*4/8];
} block_isoquant4_64;

// value 4*lane + k of a block (k = 0..3), d*cb[index]: index k + 4*(lane & 1) of the group of 8 at qs[bits*(lane/2)]
// (P: a device or threadgroup pointer to the block's qs)
template <short BITS, short QK, typename P>
static inline float4 rq_iso_codes(P qs, ushort lane, float d) {
    constant const float * cb = QK == QK_ISO ? (BITS == 3 ? iq3_codebook    : iq4_codebook)
                                             : (BITS == 3 ? iq3_64_codebook : iq4_64_codebook);
    const short g = lane/2;
    uint w = 0;
    for (short b = 0; b < BITS; ++b) {
        w |= (uint) qs[BITS*g + b] << (8*b);
    }
    const short sh = BITS*4*(lane & 1);
    const uint  m  = (1u << BITS) - 1;
    float4 y;
    for (short k = 0; k < 4; ++k) {
        y[k] = d * cb[(w >> (sh + BITS*k)) & m];
    }
    return y;
}

// the Walsh-Hadamard transform of the block, unscaled: h = 1, 2 inside the lane, h = 4 .. QK/2 between lanes
// lane and lane ^ h/4
template <short QK>
static inline float4 rq_iso_wht(float4 t, ushort lane) {
    float4 u;
    u[0] = t[0] + t[1]; u[1] = t[0] - t[1]; u[2] = t[2] + t[3]; u[3] = t[2] - t[3];
    t[0] = u[0] + u[2]; t[2] = u[0] - u[2]; t[1] = u[1] + u[3]; t[3] = u[1] - u[3];
    for (ushort h = 1; h < QK/4; h <<= 1) {
#if defined(RQ_MTL_BREAK_SHUFFLE)
        const float4 o = simd_shuffle_xor(t, (ushort) (h == 2 ? 3 : h)); // deliberately wrong partner (tests/metal)
#else
        const float4 o = simd_shuffle_xor(t, h);
#endif
        t = (lane & h) ? o - t : t + o;
    }
    return t;
}

// y = R x = SO4(WHT(signs x)) for the block whose values 4*lane..4*lane+3 this lane holds (QK/4 lanes take part)
template <short QK>
static inline float4 rq_iso_rotate(float4 x, ushort lane) {
    float4 t;
    for (short k = 0; k < 4; ++k) {
        t[k] = x[k]*iq3_signs[4*lane + k];
    }
    t = rq_iso_wht<QK>(t, lane);
    const float scale = QK == QK_ISO ? iq3_wht_scale : iq64_wht_scale;
    for (short k = 0; k < 4; ++k) {
        t[k] = t[k]*scale;
    }
    constant const float * m = iq3_so4[lane];
    float4 y;
    for (short r = 0; r < 4; ++r) {
        y[r] = ((m[r*4 + 0]*t[0] + m[r*4 + 1]*t[1]) + m[r*4 + 2]*t[2]) + m[r*4 + 3]*t[3];
    }
    return y;
}

// x = R^-1 y
template <short QK>
static inline float4 rq_iso_rotate_inv(float4 y, ushort lane) {
    constant const float * m = iq3_so4[lane];
    float4 t;
    for (short r = 0; r < 4; ++r) {
        t[r] = ((m[0*4 + r]*y[0] + m[1*4 + r]*y[1]) + m[2*4 + r]*y[2]) + m[3*4 + r]*y[3];
    }
    t = rq_iso_wht<QK>(t, lane);
    const float scale = QK == QK_ISO ? iq3_wht_scale : iq64_wht_scale;
    float4 x;
    for (short k = 0; k < 4; ++k) {
        x[k] = (t[k]*scale)*iq3_signs[4*lane + k];
    }
    return x;
}
