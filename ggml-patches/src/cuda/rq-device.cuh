// RotaryQuant device helpers: the constant tables in device memory and warp-cooperative transforms.
//
// Lane layout, used by every kernel here:
//   ISOQUANT3_0/4_0 (128 values): lane l holds v[e] = x[4l + e], e = 0..3, i.e. exactly SO(4) group l.
//     WHT butterflies of length 1 and 2 stay in the lane, lengths 4..64 pair lane l with l ^ 1..16.
//   ISOQUANT3_64/4_64 (64 values): the same in a group of 16 lanes (l = lane % 16, lengths 4..32 pair l
//     with l ^ 1..8), so a warp holds two blocks, lanes 0..15 and 16..31; shuffles never cross the halves.
//   ITQ3_S (256 values):      lane l holds v[e] = x[8l + e], e = 0..7; lengths 1, 2, 4 in the lane,
//     8..128 across lanes.
// Every rounding step is spelled with __fadd_rn/__fsub_rn/__fmul_rn (never contracted into an FMA), in
// the operation order of ggml-rq/isoquant.c and itq3.c. Compiled without -use_fast_math (rq-iso.cu)
// the results are bit-identical to the C reference; under fast math (denormals flushed) they differ
// only for subnormal intermediates.
#pragma once

#include "ggml-cuda/common.cuh"
#include "ggml-rq.h"

#include <type_traits>

// the generated headers define every table; a file uses only some of them
#pragma nv_diag_suppress 177
#include "isoquant-tables.cuh"
#include "itq3-tables.cuh"
#pragma nv_diag_default 177

#define RQ_FULL_MASK 0xffffffffu

static_assert(QK_ISO == 4*WARP_SIZE, "one SO(4) group per lane");
static_assert(QK_ISO64 == 2*WARP_SIZE, "two 64-value blocks per warp");
static_assert(QK_ITQ == 8*WARP_SIZE, "8 ITQ3_S values per lane");

// the lane's index in its group of NL lanes (NL = 32: the warp; 16: one 64-value IsoQuant block)
template <int NL = WARP_SIZE>
static __device__ __forceinline__ int rq_lane() {
    return threadIdx.x % NL;
}

// normalised WHT of NL*NV values held by a group of NL lanes (lane l holds NV*l .. NV*l + NV-1): butterflies
// of length 1 .. NV/2 in the lane, NV .. NV*NL/2 across lanes (element e of the lower lane pairs with e of
// lane ^ m; lower a + b, upper a - b), then v *= scale. The order of isoquant.c's iq3_fwht / itq3.c's
// ggml_rq_fwht256. All 32 lanes of the warp take part (groups side by side transform independently).
template <int NV, int NL = WARP_SIZE>
static __device__ __forceinline__ void rq_wht_warp(float v[NV], const float scale) {
    const int lane = rq_lane<NL>();
#pragma unroll
    for (int h = 1; h < NV; h <<= 1) {
#pragma unroll
        for (int e = 0; e < NV; ++e) {
            if ((e & h) == 0) {
                const float a = v[e];
                const float b = v[e + h];
                v[e]     = __fadd_rn(a, b);
                v[e + h] = __fsub_rn(a, b);
            }
        }
    }
#pragma unroll
    for (int m = 1; m < NL; m <<= 1) {
        const bool upper = lane & m;
#pragma unroll
        for (int e = 0; e < NV; ++e) {
            const float p = __shfl_xor_sync(RQ_FULL_MASK, v[e], m);
            v[e] = upper ? __fsub_rn(p, v[e]) : __fadd_rn(v[e], p);
        }
    }
#pragma unroll
    for (int e = 0; e < NV; ++e) {
        v[e] = __fmul_rn(v[e], scale);
    }
}

// ---------------------------------------------------------------------------------------------
// IsoQuant rotation R = SO4 o WHT o diag(S) (variant v3; v2/v1/none are research switches) on a block of
// QK = 128 or 64 values; the 64-wide one is WHT-64 with the first 64 signs and the first 16 SO(4) groups

static __device__ __forceinline__ void rq_iso_wht_warp(float v[4]) {
    rq_wht_warp<4>(v, iq3_wht_scale);
}

template <int QK>
static __device__ __forceinline__ void rq_iso_wht_qk(float v[4]) {
    static_assert(QK == QK_ISO || QK == QK_ISO64, "IsoQuant block width");
    if constexpr (QK == QK_ISO) {
        rq_iso_wht_warp(v);
    } else {
        rq_wht_warp<4, QK/4>(v, iq64_wht_scale);
    }
}

// y = M u (row-major 4x4 of group `lane`), or y = M^T u
template <bool transpose>
static __device__ __forceinline__ void rq_iso_block4(const float * M, float v[4]) {
    float m[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        m[k] = M[k];
    }
    float y[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float m0 = transpose ? m[0*4 + r] : m[r*4 + 0];
        const float m1 = transpose ? m[1*4 + r] : m[r*4 + 1];
        const float m2 = transpose ? m[2*4 + r] : m[r*4 + 2];
        const float m3 = transpose ? m[3*4 + r] : m[r*4 + 3];
        y[r] = __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(m0, v[0]), __fmul_rn(m1, v[1])), __fmul_rn(m2, v[2])), __fmul_rn(m3, v[3]));
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        v[r] = y[r];
    }
}

// v <- R v (ggml_rq_iso_rotate_qk); all 32 lanes must take part
template <int QK = QK_ISO>
static __device__ __forceinline__ void rq_iso_rotate_warp(float v[4], const int variant) {
    const int lane = rq_lane<QK/4>();
    if (variant == GGML_RQ_ISO_V3 || variant == GGML_RQ_ISO_V1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[e] = __fmul_rn(v[e], iq3_signs[4*lane + e]);
        }
        rq_iso_wht_qk<QK>(v);
    }
    if (variant == GGML_RQ_ISO_V1) {
        rq_iso_block4<false>(iq3_so3[lane], v);
    } else if (variant != GGML_RQ_ISO_NONE) {
        rq_iso_block4<false>(iq3_so4[lane], v);
    }
}

// v <- R^T v (ggml_rq_iso_rotate_inv_qk); all 32 lanes must take part
template <int QK = QK_ISO>
static __device__ __forceinline__ void rq_iso_rotate_inv_warp(float v[4], const int variant) {
    const int lane = rq_lane<QK/4>();
    if (variant == GGML_RQ_ISO_V1) {
        rq_iso_block4<true>(iq3_so3[lane], v);
    } else if (variant != GGML_RQ_ISO_NONE) {
        rq_iso_block4<true>(iq3_so4[lane], v);
    }
    if (variant == GGML_RQ_ISO_V3 || variant == GGML_RQ_ISO_V1) {
        rq_iso_wht_qk<QK>(v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[e] = __fmul_rn(v[e], iq3_signs[4*lane + e]);
        }
    }
}

// the IsoQuant types: index width BITS = 3 or 4, block width QK = 128 (ISOQUANT3_0/4_0) or 64
// (ISOQUANT3_64/4_64); same rotation rule, scale and packing (group g of 8 indices: BITS bytes at qs[BITS*g])
template <int BITS, int QK = QK_ISO> struct rq_iso_fmt;
template <> struct rq_iso_fmt<3, QK_ISO>   { using block = block_isoquant3_0;  static constexpr ggml_type type = GGML_TYPE_ISOQUANT3_0;  };
template <> struct rq_iso_fmt<4, QK_ISO>   { using block = block_isoquant4_0;  static constexpr ggml_type type = GGML_TYPE_ISOQUANT4_0;  };
template <> struct rq_iso_fmt<3, QK_ISO64> { using block = block_isoquant3_64; static constexpr ggml_type type = GGML_TYPE_ISOQUANT3_64; };
template <> struct rq_iso_fmt<4, QK_ISO64> { using block = block_isoquant4_64; static constexpr ggml_type type = GGML_TYPE_ISOQUANT4_64; };

// codebook level i, or (BOUND) decision threshold i, of the BITS-bit codebook of QK-value blocks
template <int BITS, bool BOUND = false, int QK = QK_ISO>
static __device__ __forceinline__ float rq_iso_level(const int i) {
    if constexpr (QK == QK_ISO64) {
        if constexpr (BITS == 3) {
            return BOUND ? iq3_64_bounds[i] : iq3_64_codebook[i];
        } else {
            return BOUND ? iq4_64_bounds[i] : iq4_64_codebook[i];
        }
    } else if constexpr (BITS == 3) {
        return BOUND ? iq3_bounds[i] : iq3_codebook[i];
    } else {
        return BOUND ? iq4_bounds[i] : iq4_codebook[i];
    }
}

// the 4*BITS index bits of lane l (indices 4l..4l+3) of a packed block: group l/2 is the BITS-byte
// little-endian word at qs[BITS*g], the even lane takes its low half
template <int BITS>
static __device__ __forceinline__ uint32_t rq_iso_lane_bits(const uint8_t * qs, const int lane) {
    const uint8_t * p = qs + BITS*(lane >> 1);
    uint32_t w = 0;
#pragma unroll
    for (int b = 0; b < BITS; ++b) {
        w |= (uint32_t) p[b] << (8*b);
    }
    return (w >> (4*BITS*(lane & 1))) & ((1u << (4*BITS)) - 1);
}

// dequantise one block into the lane's 4 values (rotated back to the original domain); the block's lanes
// are a group of QK/4 (all 32 lanes of the warp take part)
template <int BITS, int QK = QK_ISO>
static __device__ __forceinline__ void rq_iso_dequant_warp(const typename rq_iso_fmt<BITS, QK>::block * b, float v[4], const int variant) {
    const int lane = rq_lane<QK/4>();
    const float    d    = __half2float(b->d);
    const uint32_t bits = rq_iso_lane_bits<BITS>(b->qs, lane);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v[e] = __fmul_rn(d, rq_iso_level<BITS, false, QK>((bits >> (BITS*e)) & ((1u << BITS) - 1)));
    }
    rq_iso_rotate_inv_warp<QK>(v, variant);
}

// calls f(std::integral_constant<int, BITS>, std::integral_constant<int, QK>) for an IsoQuant type (host side)
template <typename F>
static void rq_iso_with_fmt(const ggml_type type, F && f) {
    using std::integral_constant;
    switch (type) {
        case GGML_TYPE_ISOQUANT3_0:  f(integral_constant<int, 3>{}, integral_constant<int, QK_ISO>{});   break;
        case GGML_TYPE_ISOQUANT4_0:  f(integral_constant<int, 4>{}, integral_constant<int, QK_ISO>{});   break;
        case GGML_TYPE_ISOQUANT3_64: f(integral_constant<int, 3>{}, integral_constant<int, QK_ISO64>{}); break;
        case GGML_TYPE_ISOQUANT4_64: f(integral_constant<int, 4>{}, integral_constant<int, QK_ISO64>{}); break;
        default: GGML_ABORT("%s: %s is not an IsoQuant type", __func__, ggml_type_name(type));
    }
}

// ---------------------------------------------------------------------------------------------
// ITQ3_S: FWHT256 (normalised, its own inverse), decode of the lane's 8 codes

static __device__ __forceinline__ void rq_fwht256_warp(float v[8]) {
    rq_wht_warp<8>(v, 0.0625f);
}

// codes 8l..8l+7 as 8 bytes (values 0..7), little endian in two words. Code i: low 2 bits in
// qs[i & 63] >> 2*(i >> 6), high bit in qh[i & 31] >> (i >> 5); for i = 8l + e that is byte e of
// qs[8(l&7)..] at field l>>3 and byte e of qh[8(l&3)..] at bit l>>2.
static __device__ __forceinline__ void rq_itq_lane_codes(const block_itq3_s * b, const int lane, uint32_t c[2]) {
    const uint32_t * qs = (const uint32_t *) (b->qs + 8*(lane & 7));
    const uint32_t * qh = (const uint32_t *) (b->qh + 8*(lane & 3));
    const int sl = 2*(lane >> 3);
    const int sh = lane >> 2;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        c[k] = ((qs[k] >> sl) & 0x03030303u) | (((qh[k] >> sh) & 0x01010101u) << 2);
    }
}

static __device__ __forceinline__ void rq_itq_dequant_warp(const block_itq3_s * b, float v[8]) {
    const int lane = rq_lane();
    const float d = __half2float(b->d);
    const float m = __half2float(b->m);
    uint32_t c[2];
    rq_itq_lane_codes(b, lane, c);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int q = (c[e >> 2] >> (8*(e & 3))) & 7;
        v[e] = __fadd_rn(__fmul_rn(d, (float) itq3_grid[q]), m);
    }
    rq_fwht256_warp(v);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        v[e] = __fmul_rn(v[e], itq3_signs[8*lane + e]);
    }
}
