// RotaryQuant CPU kernels: scalar reference first, AVX2 behind it.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-impl.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "ggml-quants.h"
#include "ggml-rq.h"
#include "rq-cpu.h"
#include "quants.h"
#include "ggml-rq/itq3-tables.h"

#include <assert.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

void quantize_row_isoquant3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoquant3_0_ref(x, (block_isoquant3_0 *) y, k);
}

void quantize_row_isoq_q(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoq_q_ref(x, (block_isoq_q *) y, k);
}

static inline uint32_t iq3_group(const uint8_t * qs, int g) {
    return qs[3*g] | (uint32_t) qs[3*g + 1] << 8 | (uint32_t) qs[3*g + 2] << 16;
}

#if defined(__AVX2__)
// the 8 indices of group g as 32-bit lanes
static inline __m256i iq3_unpack8(const uint8_t * qs, int g, __m256i shifts, __m256i mask) {
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int) iq3_group(qs, g)), shifts), mask);
}

static inline float hsum_f32_8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#endif

void ggml_vec_dot_isoquant3_0_isoq_q(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                     const void * GGML_RESTRICT vy, size_t by, int nrc) {
    assert(nrc == 1);
    assert(n % QK_ISO == 0);
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);

    const block_isoquant3_0 * GGML_RESTRICT x = vx;
    const block_isoq_q      * GGML_RESTRICT y = vy;
    const int nb = n / QK_ISO;

#if defined(__AVX2__)
    const __m256  cb     = _mm256_loadu_ps(ggml_rq_iso_codebook());
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    const __m256i mask   = _mm256_set1_epi32(7);
    __m256 acc = _mm256_setzero_ps();
    for (int ib = 0; ib < nb; ++ib) {
        const float * q = y[ib].qr;
        __m256 a0 = _mm256_setzero_ps();
        __m256 a1 = _mm256_setzero_ps();
        for (int g = 0; g < QK_ISO/8; g += 2) {
            const __m256 c0 = _mm256_permutevar8x32_ps(cb, iq3_unpack8(x[ib].qs, g + 0, shifts, mask));
            const __m256 c1 = _mm256_permutevar8x32_ps(cb, iq3_unpack8(x[ib].qs, g + 1, shifts, mask));
            a0 = _mm256_fmadd_ps(c0, _mm256_loadu_ps(q + 8*g + 0), a0);
            a1 = _mm256_fmadd_ps(c1, _mm256_loadu_ps(q + 8*g + 8), a1);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].d)), _mm256_add_ps(a0, a1), acc);
    }
    *s = hsum_f32_8(acc);
#else
    const float * cb = ggml_rq_iso_codebook();
    float sumf = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        const float * q = y[ib].qr;
        float sum = 0.0f;
        for (int g = 0; g < QK_ISO/8; ++g) {
            const uint32_t w = iq3_group(x[ib].qs, g);
            for (int j = 0; j < 8; ++j) {
                sum += cb[(w >> (3*j)) & 7] * q[8*g + j];
            }
        }
        sumf += sum * GGML_CPU_FP16_TO_FP32(x[ib].d);
    }
    *s = sumf;
#endif
}

void ggml_rq_iso_mad_rot(int n, float * GGML_RESTRICT acc, const void * GGML_RESTRICT vx, float v) {
    assert(n % QK_ISO == 0);
    const block_isoquant3_0 * GGML_RESTRICT x = vx;
    const int nb = n / QK_ISO;

#if defined(__AVX2__)
    const __m256  cb     = _mm256_loadu_ps(ggml_rq_iso_codebook());
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    const __m256i mask   = _mm256_set1_epi32(7);
    for (int ib = 0; ib < nb; ++ib) {
        const __m256 cbs = _mm256_mul_ps(cb, _mm256_set1_ps(v*GGML_CPU_FP16_TO_FP32(x[ib].d)));
        float * a = acc + ib*QK_ISO;
        for (int g = 0; g < QK_ISO/8; ++g) {
            const __m256 c = _mm256_permutevar8x32_ps(cbs, iq3_unpack8(x[ib].qs, g, shifts, mask));
            _mm256_storeu_ps(a + 8*g, _mm256_add_ps(_mm256_loadu_ps(a + 8*g), c));
        }
    }
#else
    const float * cb = ggml_rq_iso_codebook();
    for (int ib = 0; ib < nb; ++ib) {
        const float vd = v*GGML_CPU_FP16_TO_FP32(x[ib].d);
        float * a = acc + ib*QK_ISO;
        for (int g = 0; g < QK_ISO/8; ++g) {
            const uint32_t w = iq3_group(x[ib].qs, g);
            for (int j = 0; j < 8; ++j) {
                a[8*g + j] += vd * cb[(w >> (3*j)) & 7];
            }
        }
    }
#endif
}

void ggml_rq_iso_unrotate(int n, float * acc) {
    assert(n % QK_ISO == 0);
    if (ggml_rq_iso_get_skip_inverse()) {
        return;
    }
    for (int ib = 0; ib < n / QK_ISO; ++ib) {
        ggml_rq_iso_rotate_inv(acc + ib*QK_ISO, acc + ib*QK_ISO);
    }
}

void ggml_rq_fa_count(enum ggml_type type_k, enum ggml_type type_v, bool use_ref) {
    if (type_k == GGML_TYPE_ISOQUANT3_0 || type_v == GGML_TYPE_ISOQUANT3_0) {
        ggml_rq_counter_add(use_ref ? GGML_RQ_ISO_FALLBACK_CALLS : GGML_RQ_ISO_FUSED_CALLS, 1);
    }
}

// ---------------------------------------------------------------------------------------------
// ITQ3_S x Q8_ITQ: both sides are in the rotated domain, so the dot product is a plain integer dot
// against the grid values: sum_b dx * (d * sum_i grid[q_i] qx_i + m * sum_i qx_i)

void quantize_row_itq3_s(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_itq3_s_ref(x, (block_itq3_s *) y, k);
}

void quantize_row_q8_itq(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ITQ == 0);
    float t[QK_ITQ];
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        for (int i = 0; i < QK_ITQ; ++i) {
            t[i] = x[ib*QK_ITQ + i]*itq3_signs[i];
        }
        ggml_rq_fwht256(t);
        quantize_row_q8_K(t, (block_q8_K *) y + ib, QK_ITQ);
    }
}

void ggml_vec_dot_itq3_s_q8_itq(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
    assert(nrc == 1);
    assert(n % QK_ITQ == 0);
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);

    const block_itq3_s * GGML_RESTRICT x = vx;
    const block_q8_K   * GGML_RESTRICT y = vy;
    const int nb = n / QK_ITQ;
    const int8_t * grid = itq3_grid;

#if defined(__AVX2__)
    // grid lookup with pshufb (8 entries, both lanes); |g| x sign(x, g) keeps maddubs in range
    const __m128i g8   = _mm_loadl_epi64((const __m128i *) grid);
    const __m256i gtab = _mm256_broadcastsi128_si256(g8);
    const __m256i m3   = _mm256_set1_epi8(3);
    const __m256i m1   = _mm256_set1_epi8(1);
    const __m256i ones = _mm256_set1_epi16(1);
    float sumf = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        const __m256i lo0 = _mm256_loadu_si256((const __m256i *) (x[ib].qs +  0));
        const __m256i lo1 = _mm256_loadu_si256((const __m256i *) (x[ib].qs + 32));
        const __m256i hi  = _mm256_loadu_si256((const __m256i *) x[ib].qh);
        __m256i acc = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
            // codes 32c..32c+31: low bits from qs[32*(c&1) + t] >> 2*(c>>1), high bit from qh[t] >> c
            const __m256i lo  = _mm256_and_si256(_mm256_srli_epi16(c & 1 ? lo1 : lo0, 2*(c >> 1)), m3);
            const __m256i h   = _mm256_and_si256(_mm256_srli_epi16(hi, c), m1);
            const __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi16(h, 2));
            const __m256i g   = _mm256_shuffle_epi8(gtab, idx);
            const __m256i q8  = _mm256_loadu_si256((const __m256i *) (y[ib].qs + 32*c));
            const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(g, g), _mm256_sign_epi8(q8, g));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, ones));
        }
        __m128i a4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        a4 = _mm_hadd_epi32(a4, a4);
        a4 = _mm_hadd_epi32(a4, a4);
        const int32_t isum = _mm_cvtsi128_si32(a4);
        int32_t qsum = 0;
        for (int j = 0; j < QK_ITQ/16; ++j) {
            qsum += y[ib].bsums[j];
        }
        sumf += y[ib].d * (GGML_CPU_FP16_TO_FP32(x[ib].d) * (float) isum + GGML_CPU_FP16_TO_FP32(x[ib].m) * (float) qsum);
    }
    *s = sumf;
#else
    float sumf = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        int32_t isum = 0, qsum = 0;
        for (int i = 0; i < QK_ITQ; ++i) {
            const int q = ((x[ib].qs[i & 63] >> (2*(i >> 6))) & 3) | (((x[ib].qh[i & 31] >> (i >> 5)) & 1) << 2);
            isum += grid[q] * y[ib].qs[i];
            qsum += y[ib].qs[i];
        }
        sumf += y[ib].d * (GGML_CPU_FP16_TO_FP32(x[ib].d) * (float) isum + GGML_CPU_FP16_TO_FP32(x[ib].m) * (float) qsum);
    }
    *s = sumf;
#endif
}
