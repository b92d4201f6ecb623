// ITQ3_S in ggml-cpu's tiled matmul (tiled/tiled.cpp includes this after tiled-kernel.h). Prompt-sized
// batches take 16x16 microtiles over codes unpacked once per tile as u = grid[q] + 127 in [0, 254], with
// Q4_K's unsigned MAC; the activations are Q8_ITQ's 7-bit codes (|q| <= 63, rq-quants.h), so maddubs pairs
// stay below 2*254*63 < 32767. The activations arrive rotated (the driver converts src1 with the
// vec_dot_type's from_float), so as in the vec_dot
//     sum_i (d grid[q_i] + m) y_i = d sum_i u_i y_i - (127 d - m) sum_i y_i = d0 raw - dmin bsum,
// with exact integer sums; only the float rounding order differs from the vec_dot.
//
// ITQ3_S has one scale and one offset per 256, so on AVX2 it has a microkernel of its own (SUBBLK tag
// 256): no per-32 scale multiply, the min term's activation sum taken once per column instead of per
// subblock and row, and the eight column sums reduced with one hadd tree. Elsewhere (AVX-512 VNNI's
// transposed activations, AVX, scalar) it takes upstream's Q4_K-shaped kernel with scales and mins of 1.
#pragma once

#include "ggml-rq/cpu/rq-cpu.h"

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#define RQ_TILED_ITQ3_SUBBLK 256
#else
#define RQ_TILED_ITQ3_SUBBLK 32
#endif

static void tiled_unpack_src0(const block_itq3_s * rows, int64_t row_stride, int n_rows, tiled_tile_src0 * tile, int num_k) {
    GGML_ASSERT(n_rows <= TILED_TILE_ROWS);
    constexpr int NB = TILED_TILE_K / 32;
    static_assert(QK_ITQ == TILED_TILE_K, "one ITQ3_S block per tiled K slab");

    const int qk_stride = num_k * TILED_TILE_K;
    const int nb_stride = NB * num_k;
    for (int slab = 0; slab < num_k; slab++) {
        for (int r = 0; r < n_rows; r++) {
            const int d_off = slab * TILED_MICRO + r;
            const int s_off = r * nb_stride + slab * NB;
            const block_itq3_s & x = rows[r * row_stride + slab];
            const float d = ggml_fp16_to_fp32(x.d);
            tile->d[d_off]    = d;
            tile->dmin[d_off] = 127.0f * d - ggml_fp16_to_fp32(x.m);
            if (RQ_TILED_ITQ3_SUBBLK == 32) {
                for (int s = 0; s < NB; s++) {
                    tile->scales[s_off + s] = 1;
                    tile->mins[s_off + s]   = 1;
                }
            }
            ggml_rq_itq3_codes(&x, &tile->q[r * qk_stride + slab * TILED_TILE_K]);
        }
    }
}

#if RQ_TILED_ITQ3_SUBBLK == 256
// no act-bias correction to precompute
template <> inline void tiled_repack_src0<256>(tiled_tile_src0 *, int, int, int, bool) {}

// 8 vectors of 8 int32 -> their 8 sums, in order
static inline __m256i rq_tiled_hsum8(const __m256i a[8]) {
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// buf[i][j] += d1_j (d0_i sum_k u_ik y_jk - dmin_i sum_k y_jk) over one 256-K slab; the layout and the
// num_k/slab convention are upstream's (tiled_run_microtile_avx2), the activations in natural layout
template <>
inline void tiled_run_microtile<256, true, 0, false>(const tiled_tile_src0 & src0, const tiled_tile_src1 & src1,
                                                     int i0, int j0, int num_k, int slab, float * buf, int buf_stride) {
    constexpr int GROUP = 8;
    const int qk_stride = num_k * TILED_TILE_K;
    const int qk_off    = slab * TILED_TILE_K;
    const int bs_stride = (num_k == 1) ? TILED_TILE_ROWS : TILED_MICRO;
    const int bs_off    = slab * TILED_MICRO;

    __m256 ysum[2], d1[2];
    for (int g = 0; g < 2; g++) {
        __m256i b = _mm256_setzero_si256();
        for (int u = 0; u < TILED_TILE_K / 16; u++) {
            b = _mm256_add_epi32(b, _mm256_load_si256((const __m256i *) &src1.bsums[(bs_off + u) * bs_stride + j0 + g * GROUP]));
        }
        ysum[g] = _mm256_cvtepi32_ps(b);
        d1[g]   = _mm256_load_ps(&src1.d[slab * TILED_MICRO + j0 + g * GROUP]);
    }
    const __m256i ones = _mm256_set1_epi16(1);

    for (int i = 0; i < TILED_MICRO; i++) {
        const int ar = i0 + i;
        const __m256 d0   = _mm256_set1_ps(src0.d[slab * TILED_MICRO + ar]);
        const __m256 dmin = _mm256_set1_ps(src0.dmin[slab * TILED_MICRO + ar]);
        const uint8_t * q0 = &src0.q[ar * qk_stride + qk_off];
        for (int g = 0; g < 2; g++) {
            const int8_t * q1 = &src1.q[(j0 + g * GROUP) * qk_stride + qk_off];
            __m256i acc[GROUP];
            for (int t = 0; t < GROUP; t++) {
                acc[t] = _mm256_setzero_si256();
            }
            for (int s = 0; s < TILED_TILE_K; s += 32) {
                const __m256i w = _mm256_load_si256((const __m256i *) &q0[s]);
#ifdef __GNUC__
                #pragma GCC unroll 8
#endif
                for (int t = 0; t < GROUP; t++) {
                    const __m256i y = _mm256_load_si256((const __m256i *) &q1[t * qk_stride + s]);
                    acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), ones));
                }
            }
            const __m256 raw = _mm256_cvtepi32_ps(rq_tiled_hsum8(acc));
            float * p = &buf[ar * buf_stride + j0 + g * GROUP];
            const __m256 r = _mm256_fnmadd_ps(dmin, ysum[g], _mm256_mul_ps(d0, raw));
            _mm256_storeu_ps(p, _mm256_fmadd_ps(r, d1[g], _mm256_loadu_ps(p)));
        }
    }
}
#endif
