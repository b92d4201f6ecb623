// RotaryQuant IsoQuant on Metal: the block formats and their dequantisation (GET_ROWS), in ggml-metal's style
// (kernels/quantize.metal). One simdgroup decodes one 128-value block: lane l holds values 4l..4l+3, which are SO(4)
// group l, so the inverse block rotation stays in the lane and only the Walsh-Hadamard stages h >= 4 cross lanes
// (simd_shuffle_xor). The float operations and their order are the C reference's (ggml-patches/src/isoquant.c):
// d*cb[i], M^T u as ((m0*u0 + m1*u1) + m2*u2) + m3*u3, butterflies (a + b, a - b), then *scale, then *sign.
//
// Never compiled by Apple's compiler here: tests/metal runs this source as C++ under an emulation of threadgroups,
// simdgroups and barriers (tests/metal/shim), which checks logic, indexing and layout, not Apple's compiler or speed.

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

// value 4*lane + k of a block (k = 0..3): index k + 4*(lane & 1) of the group of 8 at qs[bits*(lane/2)]
template <short BITS, short QK>
static inline float4 rq_iso_codes(threadgroup const uchar * qs, ushort lane, float d) {
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

// x = R^-1 y for the block whose values 4*lane..4*lane+3 this lane holds (QK/4 lanes take part)
template <short QK>
static inline float4 rq_iso_rotate_inv(float4 y, ushort lane) {
    constant const float * m = iq3_so4[lane];
    float4 t;
    for (short r = 0; r < 4; ++r) {
        t[r] = ((m[0*4 + r]*y[0] + m[1*4 + r]*y[1]) + m[2*4 + r]*y[2]) + m[3*4 + r]*y[3];
    }
    // Walsh-Hadamard: h = 1, 2 inside the lane, h = 4 .. QK/2 between lanes lane and lane ^ h/4
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
    const float scale = QK == QK_ISO ? iq3_wht_scale : iq64_wht_scale;
    float4 x;
    for (short k = 0; k < 4; ++k) {
        x[k] = (t[k]*scale)*iq3_signs[4*lane + k];
    }
    return x;
}

// GET_ROWS on the grid of upstream's kernel_get_rows_q: threadgroup (i10 + ne10*iw0, i11, i12), here one simdgroup
// per row (iw0 = 0) that walks the row's blocks; a block's bytes are staged in threadgroup memory by all lanes
template <typename block_q, short BITS, short QK>
kernel void kernel_get_rows_iso(
        constant ggml_metal_kargs_get_rows & args,
        device const void * src0,
        device const void * src1,
        device       void * dst,
        threadgroup uchar * shmem [[threadgroup(0)]],
        uint3               tgpig[[threadgroup_position_in_grid]],
        ushort              tiisg[[thread_index_in_simdgroup]]) {
    const int32_t i10 = tgpig.x;
    const int32_t i11 = tgpig.y;
    const int32_t i12 = tgpig.z;

    const int32_t r = ((const device int32_t *) ((const device char *) src1 + i12*args.nb12 + i11*args.nb11 + i10*args.nb10))[0];

    device const uchar * psrc = (device const uchar *) src0 + i12*args.nb03 + i11*args.nb02 + r*args.nb01;
    device       float * pdst = (device float *) ((device char *) dst + i12*args.nb3 + i11*args.nb2 + i10*args.nb1);

    const int nb = args.ne00/QK;
    for (int ib = 0; ib < nb; ++ib) {
        device const uchar * blk = psrc + ib*sizeof(block_q);
        for (ushort i = tiisg; i < sizeof(block_q); i += N_SIMDWIDTH) {
            shmem[i] = blk[i];
        }
#if !defined(RQ_MTL_BREAK_BARRIER)
        threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
        if (tiisg < QK/4) {
            const float d = (float) ((threadgroup const block_q *) shmem)->d;
            const float4 y = rq_iso_codes<BITS, QK>(shmem + sizeof(half), tiisg, d);
            const float4 x = rq_iso_rotate_inv<QK>(y, tiisg);
            for (short k = 0; k < 4; ++k) {
                pdst[ib*QK + 4*tiisg + k] = x[k];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup); // the next block overwrites shmem
    }
}

typedef decltype(kernel_get_rows_iso<block_isoquant3_0, 3, QK_ISO>) get_rows_iso_t;

template [[host_name("kernel_get_rows_isoquant3_0")]]  kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant3_0,  3, QK_ISO>;
template [[host_name("kernel_get_rows_isoquant4_0")]]  kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant4_0,  4, QK_ISO>;
template [[host_name("kernel_get_rows_isoquant3_64")]] kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant3_64, 3, QK_ISO64>;
template [[host_name("kernel_get_rows_isoquant4_64")]] kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant4_64, 4, QK_ISO64>;
