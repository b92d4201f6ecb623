// RotaryQuant CPU kernels: scalar reference first, AVX2 and NEON (AArch64) behind it.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-impl.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "ggml-quants.h"
#include "ggml-rq.h"
#include "rq-cpu.h"
#include "quants.h"
#include "vec.h"
#include "ggml-rq/itq3-tables.h"

#include <assert.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define RQ_NEON
#endif

void quantize_row_isoquant3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoquant3_0_ref(x, (block_isoquant3_0 *) y, k);
}

void quantize_row_isoquant4_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoquant4_0_ref(x, (block_isoquant4_0 *) y, k);
}

void quantize_row_isoq_q(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoq_q_ref(x, (block_isoq_q *) y, k);
}

void quantize_row_isoquant3_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoquant3_64_ref(x, (block_isoquant3_64 *) y, k);
}

void quantize_row_isoquant4_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoquant4_64_ref(x, (block_isoquant4_64 *) y, k);
}

void quantize_row_isoq_q64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_isoq_q64_ref(x, (block_isoq_q64 *) y, k);
}

// the IsoQuant helpers below take the index width (bits) and the block width (qk = 128 or 64) as arguments;
// forced inlining with constants makes every lookup as tight as a width-specific kernel (measured: 30 % slower
// without)
#if defined(__GNUC__)
#define RQ_INLINE static inline __attribute__((always_inline))
#else
#define RQ_INLINE static inline
#endif

// IsoQuant blocks of any width: d (fp16) then qk*bits/8 bytes of packed indices
RQ_INLINE const uint8_t * iso_block(const void * x, int64_t ib, int bits, int qk) {
    return (const uint8_t *) x + ib*(int64_t) (sizeof(ggml_half) + qk*bits/8);
}

RQ_INLINE float iso_block_d(const uint8_t * blk) {
    ggml_half d;
    memcpy(&d, blk, sizeof(d));
    return GGML_CPU_FP16_TO_FP32(d);
}

// the bits*8-bit word of group g of a block's packed indices (ggml_rq_iso_word) in one 4-byte load: at the group's
// first byte wherever the block has a byte after the group (the top byte is never shifted into an index: lanes
// read bits 0..8*bits-1), and for the last group of a 3-bit block, which may end the buffer, one byte earlier and
// shifted down (a byte loop there cost the 3-bit unpack 13 instructions per 8 values and kept loops rolled)
RQ_INLINE uint32_t iso_word(const uint8_t * qs, int g, int bits, int ng) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t w;
    if (bits == 4 || g < ng - 1) {
        memcpy(&w, qs + bits*g, sizeof(w));
        return w;
    }
    memcpy(&w, qs + bits*g - 1, sizeof(w));
    return w >> 8;
#else
    GGML_UNUSED(ng);
    return ggml_rq_iso_word(qs, g, bits);
#endif
}

#if defined(__AVX2__)
// codebook lookup for the 8 indices of one group: 8 levels in one register, 16 in two (the 4th index
// bit, moved to the sign bit, selects the register); no mask: vpermps reads an index's low 3 bits, and the
// 4th bit is shifted to the top, so the bits above a lane's index are never read
typedef struct {
    __m256  lo, hi;
    __m256i shifts;
    int     bits, ng;   // index width, groups of 8 per block
} iso_lut;

RQ_INLINE iso_lut iso_lut_init(int bits, int qk) {
    const float * cb = ggml_rq_iso_codebook_qk(bits, qk);
    iso_lut L;
    L.lo     = _mm256_loadu_ps(cb);
    L.hi     = bits == 4 ? _mm256_loadu_ps(cb + 8) : L.lo;
    L.shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    L.bits   = bits;
    L.ng     = qk/8;
    return L;
}

RQ_INLINE __m256 iso_lookup8(const iso_lut * L, const uint8_t * qs, int g) {
    const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int) iso_word(qs, g, L->bits, L->ng)), L->shifts);
    const __m256  lo  = _mm256_permutevar8x32_ps(L->lo, idx);
    if (L->bits == 3) {
        return lo;
    }
    return _mm256_blendv_ps(lo, _mm256_permutevar8x32_ps(L->hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

static inline float hsum_f32_8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#elif defined(RQ_NEON)
// the same lookup with tbl: the codebook's bytes in four table registers (8 levels use two), index i
// of a lane becomes the byte indices 4i..4i+3 of its float; lanes hold indices 0-3 and 4-7 of a group
typedef struct {
    uint8x16x4_t tab;
    int32x4_t    sh0, sh1; // -bits*j: right shifts of the group word for lanes j = 0-3, 4-7
    uint32x4_t   mask;
    int          bits, ng;  // index width, groups of 8 per block
} iso_lut;

RQ_INLINE iso_lut iso_lut_init(int bits, int qk) {
    const float * cb = ggml_rq_iso_codebook_qk(bits, qk);
    const int32_t j[4] = { 0, 1, 2, 3 };
    iso_lut L;
    L.tab.val[0] = vreinterpretq_u8_f32(vld1q_f32(cb + 0));
    L.tab.val[1] = vreinterpretq_u8_f32(vld1q_f32(cb + 4));
    L.tab.val[2] = bits == 4 ? vreinterpretq_u8_f32(vld1q_f32(cb +  8)) : L.tab.val[0];
    L.tab.val[3] = bits == 4 ? vreinterpretq_u8_f32(vld1q_f32(cb + 12)) : L.tab.val[1];
    L.sh0  = vmulq_n_s32(vld1q_s32(j), -bits);
    L.sh1  = vmulq_n_s32(vaddq_s32(vld1q_s32(j), vdupq_n_s32(4)), -bits);
    L.mask = vdupq_n_u32((1u << bits) - 1);
    L.bits = bits;
    L.ng   = qk/8;
    return L;
}

RQ_INLINE float32x4_t iso_lookup4(const iso_lut * L, uint32x4_t idx) {
    const uint8x16_t b = vreinterpretq_u8_u32(vmlaq_n_u32(vdupq_n_u32(0x03020100), idx, 0x04040404));
    return vreinterpretq_f32_u8(vqtbl4q_u8(L->tab, b));
}

RQ_INLINE float32x4x2_t iso_lookup8(const iso_lut * L, const uint8_t * qs, int g) {
    const uint32x4_t w = vdupq_n_u32(iso_word(qs, g, L->bits, L->ng));
    float32x4x2_t r;
    r.val[0] = iso_lookup4(L, vandq_u32(vshlq_u32(w, L->sh0), L->mask));
    r.val[1] = iso_lookup4(L, vandq_u32(vshlq_u32(w, L->sh1), L->mask));
    return r;
}
#endif

// sum_b ||x_b|| * <c[idx_b], (R q)_b> for `bits`-bit IsoQuant blocks of qk values; y: the rotated query
// (ISOQ_Q / ISOQ_Q64 rows are n plain floats)
RQ_INLINE float iso_vec_dot(int n, const void * GGML_RESTRICT vx, const float * GGML_RESTRICT y, int bits, int qk) {
    const int nb = n / qk;
#if defined(__AVX2__)
    const iso_lut L = iso_lut_init(bits, qk);
    __m256 acc = _mm256_setzero_ps();
    for (int ib = 0; ib < nb; ++ib) {
        const uint8_t * blk = iso_block(vx, ib, bits, qk);
        const uint8_t * qs  = blk + sizeof(ggml_half);
        const float   * q   = y + ib*qk;
        __m256 a0 = _mm256_setzero_ps();
        __m256 a1 = _mm256_setzero_ps();
        for (int g = 0; g < qk/8; g += 2) {
            a0 = _mm256_fmadd_ps(iso_lookup8(&L, qs, g + 0), _mm256_loadu_ps(q + 8*g + 0), a0);
            a1 = _mm256_fmadd_ps(iso_lookup8(&L, qs, g + 1), _mm256_loadu_ps(q + 8*g + 8), a1);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(iso_block_d(blk)), _mm256_add_ps(a0, a1), acc);
    }
    return hsum_f32_8(acc);
#elif defined(RQ_NEON)
    const iso_lut L = iso_lut_init(bits, qk);
    float32x4_t acc0 = vdupq_n_f32(0.0f);
    float32x4_t acc1 = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < nb; ++ib) {
        const uint8_t * blk = iso_block(vx, ib, bits, qk);
        const uint8_t * qs  = blk + sizeof(ggml_half);
        const float   * q   = y + ib*qk;
        float32x4_t a0 = vdupq_n_f32(0.0f);
        float32x4_t a1 = vdupq_n_f32(0.0f);
        for (int g = 0; g < qk/8; ++g) {
            const float32x4x2_t c = iso_lookup8(&L, qs, g);
            a0 = vfmaq_f32(a0, c.val[0], vld1q_f32(q + 8*g + 0));
            a1 = vfmaq_f32(a1, c.val[1], vld1q_f32(q + 8*g + 4));
        }
        const float32x4_t d = vdupq_n_f32(iso_block_d(blk));
        acc0 = vfmaq_f32(acc0, d, a0);
        acc1 = vfmaq_f32(acc1, d, a1);
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1));
#else
    const float  * cb   = ggml_rq_iso_codebook_qk(bits, qk);
    const uint32_t mask = (1u << bits) - 1;
    float sumf = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        const uint8_t * blk = iso_block(vx, ib, bits, qk);
        const float   * q   = y + ib*qk;
        float sum = 0.0f;
        for (int g = 0; g < qk/8; ++g) {
            const uint32_t w = ggml_rq_iso_word(blk + sizeof(ggml_half), g, bits);
            for (int j = 0; j < 8; ++j) {
                sum += cb[(w >> (bits*j)) & mask] * q[8*g + j];
            }
        }
        sumf += sum * iso_block_d(blk);
    }
    return sumf;
#endif
}

#define ISO_VEC_DOT(name, qname, bits, qk)                                                                            \
void ggml_vec_dot_##name##_##qname(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                                   const void * GGML_RESTRICT vy, size_t by, int nrc) {                               \
    assert(nrc == 1 && n % (qk) == 0);                                                                                \
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);                                              \
    *s = iso_vec_dot(n, vx, (const float *) vy, bits, qk);                                                            \
}

ISO_VEC_DOT(isoquant3_0,  isoq_q,   3, QK_ISO)
ISO_VEC_DOT(isoquant4_0,  isoq_q,   4, QK_ISO)
ISO_VEC_DOT(isoquant3_64, isoq_q64, 3, QK_ISO64)
ISO_VEC_DOT(isoquant4_64, isoq_q64, 4, QK_ISO64)

void ggml_rq_iso_unrotate_qk(int n, float * acc, int qk) {
    assert(n % qk == 0);
    if (ggml_rq_iso_get_skip_inverse()) {
        return;
    }
    for (int ib = 0; ib < n / qk; ++ib) {
        ggml_rq_iso_rotate_inv_qk(acc + ib*qk, acc + ib*qk, qk);
    }
}

void ggml_rq_iso_unrotate(int n, float * acc) {
    ggml_rq_iso_unrotate_qk(n, acc, QK_ISO);
}

#if !defined(__AVX2__)
// codebook values (unscaled) and block norms of one packed row: what the kernels above compute per
// call, computed once per key for all query rows that share it
RQ_INLINE void iso_unpack_bits(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk) {
#if defined(RQ_NEON)
    const iso_lut L = iso_lut_init(bits, qk);
#else
    const float  * cb   = ggml_rq_iso_codebook_qk(bits, qk);
    const uint32_t mask = (1u << bits) - 1;
#endif
    for (int ib = 0; ib < n / qk; ++ib) {
        const uint8_t * blk    = iso_block(x, ib, bits, qk);
        const uint8_t * qs     = blk + sizeof(ggml_half);
        float         * cb_out = c + ib*qk;
        d[ib] = iso_block_d(blk);
        for (int g = 0; g < qk/8; ++g) {
#if defined(RQ_NEON)
            const float32x4x2_t v = iso_lookup8(&L, qs, g);
            vst1q_f32(cb_out + 8*g + 0, v.val[0]);
            vst1q_f32(cb_out + 8*g + 4, v.val[1]);
#else
            const uint32_t w = ggml_rq_iso_word(qs, g, bits);
            for (int j = 0; j < 8; ++j) {
                cb_out[8*g + j] = cb[(w >> (bits*j)) & mask];
            }
#endif
        }
    }
}

static void iso_unpack(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk) {
    if (qk == QK_ISO) {
        if (bits == 3) {
            iso_unpack_bits(n, x, c, d, 3, QK_ISO);
        } else {
            iso_unpack_bits(n, x, c, d, 4, QK_ISO);
        }
    } else {
        if (bits == 3) {
            iso_unpack_bits(n, x, c, d, 3, QK_ISO64);
        } else {
            iso_unpack_bits(n, x, c, d, 4, QK_ISO64);
        }
    }
}
#endif

#if !defined(__AVX2__)
// iso_vec_dot on an unpacked row: the same operations in the same order (AVX2 scores packed keys: iso_score_rows)
static float iso_dot_unpacked(int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, const float * GGML_RESTRICT q, int qk) {
    const int nb = n / qk;
#if defined(RQ_NEON)
    float32x4_t acc0 = vdupq_n_f32(0.0f);
    float32x4_t acc1 = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < nb; ++ib) {
        const float * cq = c + ib*qk;
        const float * qq = q + ib*qk;
        float32x4_t a0 = vdupq_n_f32(0.0f);
        float32x4_t a1 = vdupq_n_f32(0.0f);
        for (int i = 0; i < qk; i += 8) {
            a0 = vfmaq_f32(a0, vld1q_f32(cq + i + 0), vld1q_f32(qq + i + 0));
            a1 = vfmaq_f32(a1, vld1q_f32(cq + i + 4), vld1q_f32(qq + i + 4));
        }
        const float32x4_t dd = vdupq_n_f32(d[ib]);
        acc0 = vfmaq_f32(acc0, dd, a0);
        acc1 = vfmaq_f32(acc1, dd, a1);
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1));
#else
    float sumf = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        float sum = 0.0f;
        for (int i = 0; i < qk; ++i) {
            sum += c[ib*qk + i] * q[ib*qk + i];
        }
        sumf += sum * d[ib];
    }
    return sumf;
#endif
}
#endif

#if !defined(__AVX2__)
// acc += v * ||x_b|| * c[idx_b] in the rotated domain, on an unpacked row
static void iso_mad_unpacked(int n, float * GGML_RESTRICT acc, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, float v, int qk) {
    for (int ib = 0; ib < n / qk; ++ib) {
        const float vd = v*d[ib];
        float       * a  = acc + ib*qk;
        const float * cb = c   + ib*qk;
#if defined(RQ_NEON)
        for (int i = 0; i < qk; i += 4) {
            vst1q_f32(a + i, vmlaq_n_f32(vld1q_f32(a + i), vld1q_f32(cb + i), vd));
        }
#else
        for (int i = 0; i < qk; ++i) {
            a[i] += vd * cb[i];
        }
#endif
    }
}
#endif

#define RQ_FA_TILE 8   // query rows of one K/V head processed together
#define RQ_FA_KB   16  // keys per online-softmax update
// Visible keys per chunk: each chunk runs its own online softmax and the chunks are folded in order (iso_fa_fold).
// A fixed count of a row's visible keys, so chunk boundaries do not depend on threads, batch or cache layout, and
// single-token decode can hand a tile's chunks to several threads (ggml_rq_fa_iso_split) with the same bits.
#define RQ_FA_CHUNK 1024

// The online softmax's weights (exps of scores less the row's max) are 0 below RQ_FA_FTZ. Such a key weighs under
// 2^-115 next to the max's 1, far under any float sum's resolution, but its exp (and its products with V) would be a
// denormal, and x86 takes a microcode assist for each one: with sharp scores (most keys > 87 below the max, as a
// model's attention at long context) the op ran 1.3x slower. Upstream's CUDA FA flushes the same way, from -20
// (SOFTMAX_FTZ_THRESHOLD). NaN stays NaN.
#define RQ_FA_FTZ (-80.0f)

static inline float iso_expf_ftz(float x) {
    return x < RQ_FA_FTZ ? 0.0f : expf(x);
}

#if defined(__AVX2__)
// 8 vectors -> their 8 horizontal sums, in order
static inline __m256 iso_hsum8(const __m256 a[8]) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// 8 exps: ggml's vector expf where vec.h defines the AVX2 one (an AVX-512 build defines a 16-wide one instead)
#if defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512DQ__))
#define iso_exp8 ggml_v_expf
#else
static inline __m256 iso_exp8(__m256 x) {
    float v[8];
    _mm256_storeu_ps(v, x);
    for (int i = 0; i < 8; ++i) {
        v[i] = expf(v[i]);
    }
    return _mm256_loadu_ps(v);
}
#endif

// 8 weights, iso_expf_ftz's
static inline __m256 iso_exp8_ftz(__m256 x) {
    const __m256 lo = _mm256_set1_ps(RQ_FA_FTZ);
    return _mm256_and_ps(iso_exp8(_mm256_max_ps(lo, x)), _mm256_cmp_ps(x, lo, _CMP_NLT_UQ));
}

// the query tile for packed keys, interleaved: group g's 8 values of row t at qi[(g*RQ_FA_TILE + t)*8], so every row
// of a group is a constant offset from one pointer (strided rows cost a register each and spilled at 6 rows)
static void iso_q_interleave(int T, int n, const float * GGML_RESTRICT q, int64_t q_stride, float * GGML_RESTRICT qi) {
    for (int g = 0; g < n/8; ++g) {
        for (int t = 0; t < T; ++t) {
            memcpy(qi + (g*RQ_FA_TILE + t)*8, q + t*q_stride + 8*g, 8*sizeof(float));
        }
    }
}

// the T rows' scores against nk packed keys x[j], into out[u[j]][0..7]: each group's codebook values are looked up
// into a register and multiplied into every row, so a key is never stored unpacked; a block's row sums are reduced
// together. One call per block of keys keeps the tables and the query tile's pointer in registers.
RQ_INLINE void iso_score_rows_t(int T, int nk, int n, const uint8_t * const * xs, const int * us, const float * GGML_RESTRICT qi,
                                const iso_lut * Lp, int bits, int qk, float (*out)[RQ_FA_TILE]) {
    iso_lut L = *Lp; // the widths as constants, the registers from the caller's table
    L.bits = bits;
    L.ng   = qk/8;
    for (int j = 0; j < nk; ++j) {
        const uint8_t * x = xs[j];
        __m256 s = _mm256_setzero_ps();
        for (int ib = 0; ib < n / qk; ++ib) {
            const uint8_t * blk = iso_block(x, ib, bits, qk);
            const uint8_t * qs  = blk + sizeof(ggml_half);
            const float   * qb  = qi + ib*qk*RQ_FA_TILE;
            // even and odd groups in two sets of sums: two chains of qk/16 FMAs per row instead of one of qk/8
            __m256 a[RQ_FA_TILE], b[RQ_FA_TILE];
            for (int t = 0; t < RQ_FA_TILE; ++t) {
                a[t] = _mm256_setzero_ps();
                b[t] = _mm256_setzero_ps();
            }
            for (int g = 0; g < qk/8; g += 2) {
                const __m256 c0 = iso_lookup8(&L, qs, g + 0);
                for (int t = 0; t < T; ++t) {
                    a[t] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(qb + ((g + 0)*RQ_FA_TILE + t)*8), a[t]);
                }
                const __m256 c1 = iso_lookup8(&L, qs, g + 1);
                for (int t = 0; t < T; ++t) {
                    b[t] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(qb + ((g + 1)*RQ_FA_TILE + t)*8), b[t]);
                }
            }
            for (int t = 0; t < T; ++t) {
                a[t] = _mm256_add_ps(a[t], b[t]);
            }
            s = _mm256_fmadd_ps(_mm256_set1_ps(iso_block_d(blk)), iso_hsum8(a), s);
        }
        _mm256_storeu_ps(out[us[j]], s);
    }
}

// vkq[t] += sum_u w[u][t] * ||v_u||_b * c_u over a block's nu packed values, for each of the T rows: each group's
// codebook values are looked up once into a register and multiplied into every row, whose 8-wide slice stays in a
// register for the whole block (the products and their order are iso_mad_rows's)
RQ_INLINE void iso_mad_rows_packed_t(int T, int nu, int n, float * GGML_RESTRICT vkq, int64_t vkq_stride,
                                     const uint8_t * const * vx, const float (*w)[RQ_FA_TILE],
                                     const iso_lut * Lp, int bits, int qk) {
    iso_lut L = *Lp;
    L.bits = bits;
    L.ng   = qk/8;
    for (int ib = 0; ib < n / qk; ++ib) {
        float           wd[RQ_FA_KB][RQ_FA_TILE];
        const uint8_t * qs[RQ_FA_KB];
        for (int u = 0; u < nu; ++u) {
            const uint8_t * blk = iso_block(vx[u], ib, bits, qk);
            const float     d   = iso_block_d(blk);
            qs[u] = blk + sizeof(ggml_half);
            for (int t = 0; t < T; ++t) {
                wd[u][t] = w[u][t]*d;
            }
        }
        // two groups at a time: two independent chains per row (each slot's sum still runs over u in order)
        for (int g = 0; g < qk/8; g += 2) {
            float * a0 = vkq + ib*qk + 8*g;
            __m256 a[RQ_FA_TILE], b[RQ_FA_TILE];
            for (int t = 0; t < T; ++t) {
                a[t] = _mm256_loadu_ps(a0 + t*vkq_stride + 0);
                b[t] = _mm256_loadu_ps(a0 + t*vkq_stride + 8);
            }
            for (int u = 0; u < nu; ++u) {
                const __m256 c0 = iso_lookup8(&L, qs[u], g + 0);
                const __m256 c1 = iso_lookup8(&L, qs[u], g + 1);
                for (int t = 0; t < T; ++t) {
                    const __m256 wt = _mm256_broadcast_ss(&wd[u][t]);
                    a[t] = _mm256_fmadd_ps(wt, c0, a[t]);
                    b[t] = _mm256_fmadd_ps(wt, c1, b[t]);
                }
            }
            for (int t = 0; t < T; ++t) {
                _mm256_storeu_ps(a0 + t*vkq_stride + 0, a[t]);
                _mm256_storeu_ps(a0 + t*vkq_stride + 8, b[t]);
            }
        }
    }
}

// the dispatch of the two kernels above: tile height, index width and block width as constants
#define RQ_ISO_T(F, B, QK, ...) switch (T) {                                    \
        case 1: F(1, __VA_ARGS__, B, QK); break;                                 \
        case 2: F(2, __VA_ARGS__, B, QK); break;                                 \
        case 3: F(3, __VA_ARGS__, B, QK); break;                                 \
        case 4: F(4, __VA_ARGS__, B, QK); break;                                 \
        case 5: F(5, __VA_ARGS__, B, QK); break;                                 \
        case 6: F(6, __VA_ARGS__, B, QK); break;                                 \
        case 7: F(7, __VA_ARGS__, B, QK); break;                                 \
        default: F(RQ_FA_TILE, __VA_ARGS__, B, QK); break; }
#define RQ_ISO_DISPATCH(F, ...)                                                  \
    static_assert(RQ_FA_TILE == 8, "the dispatch covers tile heights 1..8");    \
    if (qk == QK_ISO) {                                                          \
        if (bits == 3) { RQ_ISO_T(F, 3, QK_ISO, __VA_ARGS__) }                   \
        else           { RQ_ISO_T(F, 4, QK_ISO, __VA_ARGS__) }                   \
    } else {                                                                     \
        if (bits == 3) { RQ_ISO_T(F, 3, QK_ISO64, __VA_ARGS__) }                 \
        else           { RQ_ISO_T(F, 4, QK_ISO64, __VA_ARGS__) }                 \
    }

#define RQ_SCORE_F(T_, nk, n, xs, us, qi, L, out, B, QK) iso_score_rows_t(T_, nk, n, xs, us, qi, L, B, QK, out)
static void iso_score_rows(int T, int nk, int n, const uint8_t * const * xs, const int * us, const float * GGML_RESTRICT qi,
                           const iso_lut * L, int bits, int qk, float (*out)[RQ_FA_TILE]) {
    RQ_ISO_DISPATCH(RQ_SCORE_F, nk, n, xs, us, qi, L, out)
}

#define RQ_MAD_F(T_, nu, n, vkq, st, vx, w, L, B, QK) iso_mad_rows_packed_t(T_, nu, n, vkq, st, vx, w, L, B, QK)
static void iso_mad_rows_packed(int T, int nu, int n, float * GGML_RESTRICT vkq, int64_t vkq_stride,
                                const uint8_t * const * vx, const float (*w)[RQ_FA_TILE],
                                const iso_lut * L, int bits, int qk) {
    RQ_ISO_DISPATCH(RQ_MAD_F, nu, n, vkq, vkq_stride, vx, w, L)
}
#undef RQ_SCORE_F
#undef RQ_MAD_F

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
// Keys scored in integers with AVX-512 VNNI (Zen 4, Sapphire Rapids: VNNI and BF16; compiled function by function and taken at
// run time, the build stays x86-64-v3). With 16-wide floats Zen 4 gains nothing (it splits a 512-bit FMA in two: the
// AVX2 kernel already runs at ~85% of the FMA peak, measured 2026-12-04), so the lever is fewer operations per
// key: vpdpbusd does 4 multiply-adds per lane. Per row and 128-value block the rotated query becomes int8,
// q8 = round(q*127/max|q|), the codebook int8 too, c8 = round(c*L/max|c|), stored as c8 + 128 (vpdpbusd's unsigned
// operand); then
//     <c[idx], q> ~ (max|c|/L) (max|q|/127) (sum_i (c8[idx_i] + 128) q8_i - 128 sum_i q8_i)
// with the sum exact in int32: a row's score is the same whatever the tile, thread or company. The int8 query is
// upstream's choice for its quantised K caches (Q8_0 as vec_dot_type); its error on a score is ~20x below 3-bit K's
// own (docs/cpu-paths.md). 128-value blocks only (ISOQUANT3_0 and 4_0); V: bf16 pairs, below.
#define RQ_AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,avx512bf16"
#define RQ_INLINE512 static inline __attribute__((always_inline, target(RQ_AVX512_TARGET)))
#define RQ_HAVE_AVX512_FA 1

// the int8 codebook as vpermb's 64-byte table (levels repeated: index bits above the width are don't-care) and its
// scale. The outer level L <= 127 is the one whose rounding moves the levels least: 3-bit, L = 113 gives 13/40/71/113,
// 0.11% rms off the codebook where L = 127 is 0.37% (its inner level 14.6 -> 15 alone 3%); that rounding is a fixed
// error of every key's score, as large as the int8 query's (numpy, 2026-12-04). 4-bit: L = 112, 0.29% vs 0.30%.
// Found once per width: the search is 64 x 16 roundings, and this runs per thread and op.
static int iso_cb_top(int bits, const float * cb, float cmax) {
    static _Atomic int found[5]; // by bits; 0: not yet (any thread may store the same value)
    int top = atomic_load_explicit(&found[bits], memory_order_relaxed);
    if (top != 0) {
        return top;
    }
    double emin = INFINITY;
    for (int L = 127; L >= 64; --L) {
        double e = 0.0;
        for (int l = 0; l < (1 << bits); ++l) {
            const double d = (double) roundf(cb[l]*(float) L/cmax)*(double) cmax/L - (double) cb[l];
            e += d*d;
        }
        if (e < emin) {
            emin = e;
            top  = L;
        }
    }
    atomic_store_explicit(&found[bits], top, memory_order_relaxed);
    return top;
}

static float iso_cb_u8(int bits, uint8_t tab[64]) {
    const float * cb = ggml_rq_iso_codebook_qk(bits, QK_ISO);
    const int     nl = 1 << bits;
    float cmax = 0.0f;
    for (int l = 0; l < nl; ++l) {
        cmax = MAX(cmax, fabsf(cb[l]));
    }
    const int top = iso_cb_top(bits, cb, cmax);
    for (int i = 0; i < 64; ++i) {
        tab[i] = (uint8_t) (roundf(cb[i % nl]*(float) top/cmax) + 128.0f);
    }
    return cmax/(float) top;
}

// the tile's int8 query for blocks of QK_ISO, in the order the key unpack below yields indices: 3-bit, two halves of
// 64 in index order; 4-bit, the even indices then the odd ones. Row t, block ib, half h: q8[((2*ib + h)*RQ_FA_TILE + t)*64].
// sc[ib][t] = max|q|/127 * cscale, bias[ib][t] = 128 sum q8 (rows t >= T: zero)
static void iso_q8_tile(int T, int n, int bits, const float * GGML_RESTRICT q, int64_t q_stride, float cscale,
                        int8_t * GGML_RESTRICT q8, float (*sc)[RQ_FA_TILE], int32_t (*bias)[RQ_FA_TILE]) {
    for (int ib = 0; ib < n/QK_ISO; ++ib) {
        for (int t = 0; t < RQ_FA_TILE; ++t) {
            int8_t * y0 = q8 + (2*ib*RQ_FA_TILE + t)*64;
            int8_t * y1 = y0 + RQ_FA_TILE*64;
            if (t >= T) {
                memset(y0, 0, 64);
                memset(y1, 0, 64);
                sc[ib][t] = 0.0f;
                bias[ib][t] = 0;
                continue;
            }
            const float * x = q + t*q_stride + ib*QK_ISO;
            float m = 0.0f;
            for (int i = 0; i < QK_ISO; ++i) {
                m = MAX(m, fabsf(x[i]));
            }
            const float inv = m > 0.0f ? 127.0f/m : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < QK_ISO; ++i) {
                const int8_t v = (int8_t) roundf(x[i]*inv);
                (bits == 3 ? (i < 64 ? y0 + i : y1 + i - 64) : (i % 2 ? y1 + i/2 : y0 + i/2))[0] = v;
                sum += v;
            }
            sc[ib][t]   = m/127.0f*cscale;
            bias[ib][t] = 128*sum;
        }
    }
}

// the unsigned int8 codebook values of one block's 128 indices, two registers in iso_q8_tile's order
RQ_INLINE512 void iso_codes_u8(const uint8_t * qs, int bits, __m512i tab, __m512i g0, __m512i g1, __m512i ctrl, __m512i u[2]) {
    if (bits == 3) {
        // 48 bytes (a masked load: nothing past the block is touched); lane i of half h gets bytes 24h + 3i.. of its 8
        // indices, vpmultishiftqb puts index j of the lane at its byte j, vpermb looks the low 3 bits up
        const __m512i x = _mm512_maskz_loadu_epi8(0x0000FFFFFFFFFFFFull, qs);
        u[0] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(ctrl, _mm512_permutexvar_epi8(g0, x)), tab);
        u[1] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(ctrl, _mm512_permutexvar_epi8(g1, x)), tab);
    } else {
        const __m512i x = _mm512_loadu_si512(qs);
        u[0] = _mm512_permutexvar_epi8(x, tab);                       // low nibbles: even indices
        u[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(x, 4), tab); // high nibbles: odd indices
    }
}

// 8 vectors of 8 int32 -> their 8 sums, in order
RQ_INLINE512 __m256i iso_hsum8_epi32(const __m256i a[8]) {
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// the T rows' scores against nk packed keys, two keys at a time sharing each load of the query tile
RQ_INLINE512 void iso_score_vnni_t(int T, int nk, int n, const uint8_t * const * xs, const int * us,
                                   const int8_t * GGML_RESTRICT q8, const float (*sc)[RQ_FA_TILE],
                                   const int32_t (*bias)[RQ_FA_TILE], const uint8_t * tab8, int bits, int qk,
                                   float (*out)[RQ_FA_TILE]) {
    GGML_UNUSED(qk);
    const __m512i tab  = _mm512_loadu_si512(tab8);
    const __m512i ctrl = _mm512_set1_epi64(0x15120f0c09060300ll); // index j of a lane at bit 3j
    // byte b of lane i of half h <- byte 24h + 3i + b of the block's indices (b < 4 is read)
    const __m512i step = _mm512_set1_epi64(0x0706050403020100ll);
    const __m512i lane = _mm512_set_epi64(21ll*0x0101010101010101ll, 18ll*0x0101010101010101ll, 15ll*0x0101010101010101ll,
                                          12ll*0x0101010101010101ll,  9ll*0x0101010101010101ll,  6ll*0x0101010101010101ll,
                                           3ll*0x0101010101010101ll,  0ll);
    const __m512i g0 = _mm512_add_epi8(lane, step), g1 = _mm512_add_epi8(g0, _mm512_set1_epi8(24));
    for (int j = 0; j < nk; j += 2) {
        const int NK = j + 1 < nk ? 2 : 1;
        __m256 s[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
        for (int ib = 0; ib < n/QK_ISO; ++ib) {
            const uint8_t * blk[2] = { iso_block(xs[j], ib, bits, QK_ISO), iso_block(xs[j + NK - 1], ib, bits, QK_ISO) };
            __m512i u[2][2], a[2][RQ_FA_TILE];
            for (int k = 0; k < NK; ++k) {
                iso_codes_u8(blk[k] + sizeof(ggml_half), bits, tab, g0, g1, ctrl, u[k]);
                for (int t = 0; t < T; ++t) {
                    a[k][t] = _mm512_setzero_si512();
                }
            }
            for (int h = 0; h < 2; ++h) {
                const int8_t * qh = q8 + (2*ib + h)*RQ_FA_TILE*64;
                for (int t = 0; t < T; ++t) {
                    const __m512i y = _mm512_loadu_si512(qh + t*64);
                    for (int k = 0; k < NK; ++k) {
                        a[k][t] = _mm512_dpbusd_epi32(a[k][t], u[k][h], y);
                    }
                }
            }
            const __m256  vsc = _mm256_loadu_ps(sc[ib]);
            const __m256i vb  = _mm256_loadu_si256((const __m256i *) bias[ib]);
            for (int k = 0; k < NK; ++k) {
                __m256i r[RQ_FA_TILE];
                for (int t = 0; t < RQ_FA_TILE; ++t) {
                    r[t] = t < T ? _mm256_add_epi32(_mm512_castsi512_si256(a[k][t]), _mm512_extracti64x4_epi64(a[k][t], 1))
                                 : _mm256_setzero_si256();
                }
                const __m256 x = _mm256_cvtepi32_ps(_mm256_sub_epi32(iso_hsum8_epi32(r), vb));
                s[k] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(iso_block_d(blk[k])), vsc), x, s[k]);
            }
        }
        for (int k = 0; k < NK; ++k) {
            _mm256_storeu_ps(out[us[j + k]], s[k]);
        }
    }
}

#define RQ_VNNI_F(T_, nk, n, xs, us, q8, sc, bias, tab, out, B, QK) iso_score_vnni_t(T_, nk, n, xs, us, q8, sc, bias, tab, B, QK, out)
__attribute__((target(RQ_AVX512_TARGET)))
static void iso_score_rows_vnni(int T, int nk, int n, const uint8_t * const * xs, const int * us, const int8_t * GGML_RESTRICT q8,
                                const float (*sc)[RQ_FA_TILE], const int32_t (*bias)[RQ_FA_TILE], const uint8_t * tab,
                                int bits, float (*out)[RQ_FA_TILE]) {
    static_assert(RQ_FA_TILE == 8, "the dispatch covers tile heights 1..8");
    if (bits == 3) { RQ_ISO_T(RQ_VNNI_F, 3, QK_ISO, nk, n, xs, us, q8, sc, bias, tab, out) }
    else           { RQ_ISO_T(RQ_VNNI_F, 4, QK_ISO, nk, n, xs, us, q8, sc, bias, tab, out) }
}
#undef RQ_VNNI_F

// V accumulated in bf16 pairs with AVX512_BF16: vdpbf16ps adds w_u c_u + w_u' c_u' of two keys to each float lane in
// one instruction, half the FMAs of the float kernel. A lane's pair is (c[idx_u], c[idx_u']) from one vpermw over a
// 32-entry bf16 codebook; the weights w d are rounded to bf16 (8 bits of mantissa, as upstream's F16 V accumulation
// rounds them to 11), the sums stay float. Each lane's operations are its row's and key pair's alone.
RQ_INLINE512 __m512i iso_idx16(const uint8_t * qs, int g, int bits, __m512i ctrl) {
    uint64_t w;
    memcpy(&w, qs + bits*g - (bits == 3 ? 2 : 0), sizeof(w)); // groups g, g+1; a 3-bit pair read from 2 bytes before it
    return _mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64((long long) w));
}

// bf16 pairs (c[idx_u], c[idx_u']) of groups g, g+1
RQ_INLINE512 __m512bh iso_pair16(const uint8_t * q0, const uint8_t * q1, int g, int bits, __m512i ctrl, __m512i tab) {
    const __m512i i0 = iso_idx16(q0, g, bits, ctrl), i1 = iso_idx16(q1, g, bits, ctrl);
    return (__m512bh) _mm512_permutexvar_epi16(_mm512_mask_blend_epi16(0xAAAAAAAAu, i0, _mm512_slli_epi32(i1, 16)), tab);
}

RQ_INLINE512 void iso_mad_bf16_t(int T, int nu, int n, float * GGML_RESTRICT vkq, int64_t vkq_stride,
                                 const uint8_t * const * vx, const float (*w)[RQ_FA_TILE], const uint16_t * tab16,
                                 int bits, int qk) {
    if (nu == 0) {
        return;
    }
    const __m512i tab = _mm512_loadu_si512(tab16);
    // lane k (dim k of the group pair) at bit 3k or 4k of the pair's word; a 3-bit word starts 16 bits in
    const __m512i lo   = _mm512_add_epi64(_mm512_set1_epi64(bits == 3 ? 16 : 0),
                                          _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi64(2*bits)));
    const __m512i ctrl = _mm512_or_si512(lo, _mm512_slli_epi64(_mm512_add_epi64(lo, _mm512_set1_epi64(bits)), 32));
    const int np = (nu + 1)/2;
    for (int ib = 0; ib < n / qk; ++ib) {
        uint32_t        wp[RQ_FA_KB/2][RQ_FA_TILE]; // the pair's two weights as bf16, the first in the low half
        const uint8_t * qs[RQ_FA_KB + 1];
        for (int u = 0; u < nu; ++u) {
            qs[u] = iso_block(vx[u], ib, bits, qk) + sizeof(ggml_half);
        }
        qs[nu] = iso_block(vx[nu - 1], ib, bits, qk) + sizeof(ggml_half); // an odd last key pairs with itself at weight 0
        for (int p = 0; p < np; ++p) {
            // a key's 8 row weights (absent rows' lanes finite) times its norm, to bf16, the pair's interleaved
            const __m256 w0 = _mm256_mul_ps(_mm256_loadu_ps(w[2*p]), _mm256_set1_ps(iso_block_d(qs[2*p] - sizeof(ggml_half))));
            const __m256 w1 = 2*p + 1 < nu ? _mm256_mul_ps(_mm256_loadu_ps(w[2*p + 1]), _mm256_set1_ps(iso_block_d(qs[2*p + 1] - sizeof(ggml_half))))
                                           : _mm256_setzero_ps();
            const __m128i b0 = (__m128i) _mm256_cvtneps_pbh(w0), b1 = (__m128i) _mm256_cvtneps_pbh(w1);
            _mm_storeu_si128((__m128i *) &wp[p][0], _mm_unpacklo_epi16(b0, b1));
            _mm_storeu_si128((__m128i *) &wp[p][4], _mm_unpackhi_epi16(b0, b1));
        }
        for (int g = 0; g < qk/8; g += 4) {
            float * a0 = vkq + ib*qk + 8*g;
            __m512 a[RQ_FA_TILE], b[RQ_FA_TILE];
            for (int t = 0; t < T; ++t) {
                a[t] = _mm512_loadu_ps(a0 + t*vkq_stride +  0);
                b[t] = _mm512_loadu_ps(a0 + t*vkq_stride + 16);
            }
            for (int p = 0; p < np; ++p) {
                const __m512bh c0 = iso_pair16(qs[2*p], qs[2*p + 1], g + 0, bits, ctrl, tab);
                const __m512bh c1 = iso_pair16(qs[2*p], qs[2*p + 1], g + 2, bits, ctrl, tab);
                for (int t = 0; t < T; ++t) {
                    const __m512bh wt = (__m512bh) _mm512_set1_epi32((int) wp[p][t]);
                    a[t] = _mm512_dpbf16_ps(a[t], c0, wt);
                    b[t] = _mm512_dpbf16_ps(b[t], c1, wt);
                }
            }
            for (int t = 0; t < T; ++t) {
                _mm512_storeu_ps(a0 + t*vkq_stride +  0, a[t]);
                _mm512_storeu_ps(a0 + t*vkq_stride + 16, b[t]);
            }
        }
    }
}

#define RQ_BF16_F(T_, nu, n, vkq, st, vx, w, tab, B, QK) iso_mad_bf16_t(T_, nu, n, vkq, st, vx, w, tab, B, QK)
__attribute__((target(RQ_AVX512_TARGET)))
static void iso_mad_rows_bf16(int T, int nu, int n, float * GGML_RESTRICT vkq, int64_t vkq_stride,
                              const uint8_t * const * vx, const float (*w)[RQ_FA_TILE], const uint16_t * tab,
                              int bits, int qk) {
    RQ_ISO_DISPATCH(RQ_BF16_F, nu, n, vkq, vkq_stride, vx, w, tab)
}
#undef RQ_BF16_F

// the bf16 codebook as vpermw's 32-entry table (levels repeated)
static void iso_cb_bf16(int bits, int qk, uint16_t tab[32]) {
    const float * cb = ggml_rq_iso_codebook_qk(bits, qk);
    for (int i = 0; i < 32; ++i) {
        tab[i] = GGML_FP32_TO_BF16(cb[i % (1 << bits)]).bits;
    }
}

// whether this CPU and OS run the kernels above (libgcc's check includes the OS saving the 512-bit state; once per op,
// a few loads of libgcc's feature words)
static bool iso_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bf16");
}
#endif
#undef RQ_ISO_DISPATCH
#undef RQ_ISO_T

// V accumulation: in bf16 pairs where the AVX-512 kernels run (iso_mad_bf16_t), else in floats
static void iso_mad_rows_any(bool avx512, int T, int nu, int n, float * GGML_RESTRICT vkq, int64_t vkq_stride,
                             const uint8_t * const * vx, const float (*w)[RQ_FA_TILE], const iso_lut * L,
                             const uint16_t * tab16, int bits, int qk) {
#if defined(RQ_HAVE_AVX512_FA)
    if (avx512) {
        iso_mad_rows_bf16(T, nu, n, vkq, vkq_stride, vx, w, tab16, bits, qk);
        return;
    }
#endif
    GGML_UNUSED(avx512); GGML_UNUSED(tab16);
    iso_mad_rows_packed(T, nu, n, vkq, vkq_stride, vx, w, L, bits, qk);
}
#else
// the T rows' scores against one unpacked key (iso_dot_unpacked per row)
static void iso_dot_rows(int T, int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d,
                         const float * GGML_RESTRICT q, int64_t q_stride, int qk, float * GGML_RESTRICT out) {
    for (int t = 0; t < T; ++t) {
        out[t] = iso_dot_unpacked(n, c, d, q + t*q_stride, qk);
    }
}
#endif

#if !defined(__AVX2__)
// vkq[t] += sum_u w[t][u] * ||v_u||_b * c_u over a block's nu unpacked values, for each of the T rows
static void iso_mad_rows(int T, int nu, int n, float * GGML_RESTRICT vkq, int64_t vkq_stride,
                         const float * GGML_RESTRICT c, const float * GGML_RESTRICT d,
                         const float (*w)[RQ_FA_KB], int qk) {
    for (int t = 0; t < T; ++t) {
        for (int u = 0; u < nu; ++u) {
            if (w[t][u] != 0.0f) {
                iso_mad_unpacked(n, vkq + t*vkq_stride, c + u*n, d + u*(n/qk), w[t][u], qk);
            }
        }
    }
}
#endif

// a row's online-softmax state: max, sum, V accumulated (rotated domain), exact rows' V (unrotated)
static void iso_fa_fold(int64_t n, bool x, float * m, float * s, float * vkq, float * vkx,
                        float mc, float sc, const float * vkqc, const float * vkxc) {
    if (mc == -INFINITY) {
        return; // no visible key in the chunk
    }
    const float mx = MAX(*m, mc);
    const float a  = iso_expf_ftz(*m - mx); // 0 for the first chunk: the total becomes the chunk's, exactly
    const float b  = iso_expf_ftz(mc - mx);
    ggml_vec_scale_f32(n, vkq, a);
    ggml_vec_mad_f32(n, vkq, vkqc, b);
    if (x) {
        ggml_vec_scale_f32(n, vkx, a);
        ggml_vec_mad_f32(n, vkx, vkxc, b);
    }
    *s = *s*a + sc*b;
    *m = mx;
}

// a row's output from its folded state: inverse rotation, exact rows' V, sinks, 1/sum, permuted into dst
static void iso_fa_finish(struct ggml_tensor * dst, const int64_t row[3], int64_t n, int qk, float m, float s,
                          float * vkq, const float * vkx) {
    const struct ggml_tensor * sinks = dst->src[4];
    ggml_rq_iso_unrotate_qk(n, vkq, qk);
    if (vkx) {
        ggml_vec_acc_f32(n, vkq, vkx);
    }
    if (sinks) {
        const float sk = ((const float *) sinks->data)[row[1]];
        float ms = 1.0f;
        float vs = 1.0f;
        if (sk > m) {
            ms = expf(m - sk);
            ggml_vec_scale_f32(n, vkq, ms);
        } else {
            vs = expf(sk - m);
        }
        s = s*ms + vs;
    }
    const float s_inv = s == 0.0f ? 0.0f : 1.0f/s;
    ggml_vec_scale_f32(n, vkq, s_inv);
    // permute(0, 2, 1, 3)
    memcpy((char *) dst->data + (row[2]*dst->ne[2]*dst->ne[1] + row[1] + row[0]*dst->ne[1])*dst->nb[1], vkq, dst->nb[1]);
}

// Rows [ir0, ir1), chunks [c0, c1) of each row's visible keys starting at cell ic0 (0, INT64_MAX, 0: all of them).
// part: one tile's chunk states, [chunk][row][m, s, V, exact V], written instead of the output (the split path).
static void iso_fa_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst, int64_t ir0, int64_t ir1,
                        int64_t c0, int64_t c1, int64_t ic0, float * part) {
    const struct ggml_tensor * q     = dst->src[0];
    const struct ggml_tensor * k     = dst->src[1];
    const struct ggml_tensor * v     = dst->src[2];
    const struct ggml_tensor * mask  = dst->src[3];
    // exact rows standing in for some cells' packed K and V (ggml_rq_flash_attn_ext_set_exact), in the cache's domain
    const struct ggml_tensor * k_x   = dst->src[5];
    const struct ggml_tensor * v_x   = dst->src[6];
    const int32_t            * xrows = dst->src[7] ? (const int32_t *) dst->src[7]->data : NULL;
    const int32_t            * xuntil = dst->src[8] ? (const int32_t *) dst->src[8]->data : NULL;
    const int32_t            * qpos   = dst->src[9] ? (const int32_t *) dst->src[9]->data : NULL;
    GGML_ASSERT(!xrows || q->type == GGML_TYPE_F32);

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, nek, k,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbk, k,   nb)
    GGML_TENSOR_LOCALS(int64_t, nev, v,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbv, v,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)
    GGML_UNUSED(ne0); GGML_UNUSED(ne3); GGML_UNUSED(nb0); GGML_UNUSED(nb2); GGML_UNUSED(nb3);
    GGML_UNUSED(neq0); GGML_UNUSED(nbq0); GGML_UNUSED(nek0); GGML_UNUSED(nek1); GGML_UNUSED(nbk0);
    GGML_UNUSED(nev0); GGML_UNUSED(nev1); GGML_UNUSED(nbv0);

    const int v_bits = ggml_rq_iso_bits(v->type);
    const int k_bits = ggml_rq_iso_bits(k->type); // 0: K is another type, scored with its own vec_dot
    const int v_qk   = ggml_rq_iso_qk(v->type);   // block (rotation) width: 128 or 64
    const int k_qk   = k_bits ? ggml_rq_iso_qk(k->type) : 1;
    GGML_ASSERT(v_bits != 0);

    const int64_t DK = k->ne[0];
    const int64_t DV = v->ne[0];

    const int64_t rk2 = neq2/nek2, rk3 = neq3/nek3;
    const int64_t rv2 = neq2/nev2, rv3 = neq3/nev3;

    float scale, max_bias, logit_softcap;
    memcpy(&scale,         (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (logit_softcap != 0) {
        scale /= logit_softcap;
    }

    const uint32_t n_head      = neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    const bool k_iso = k_bits != 0;
    const enum ggml_type    k_vec_dot_type = ggml_get_type_traits_cpu(k->type)->vec_dot_type;
    const ggml_from_float_t q_to_vec_dot   = ggml_get_type_traits_cpu(k_vec_dot_type)->from_float;
    const ggml_vec_dot_t    kq_vec_dot     = ggml_get_type_traits_cpu(k->type)->vec_dot;
    GGML_ASSERT(q_to_vec_dot && "fattn: unsupported K-type");

    const size_t qrow = ggml_row_size(k_vec_dot_type, DK);

    // per-tile state: what each query row of the tile owns
    float         VKQ[RQ_FA_TILE][DV];
    float         Q32[RQ_FA_TILE][qrow/sizeof(float) + 1];
    float         M[RQ_FA_TILE], S[RQ_FA_TILE], slope[RQ_FA_TILE];
    int64_t       row[RQ_FA_TILE][3];
    // the chunks folded so far (VKQ, VKX, M, S hold the current chunk's)
    float         Mt[RQ_FA_TILE], St[RQ_FA_TILE], VKQt[RQ_FA_TILE][DV];
#if defined(__AVX2__)
    // packed keys and values are read in place: the codebooks once, the query tile interleaved, the block's V rows
    const iso_lut    Lk = iso_lut_init(k_iso ? k_bits : 3, k_iso ? k_qk : QK_ISO);
    const iso_lut    Lv = iso_lut_init(v_bits, v_qk);
    float            QI[k_iso ? DK*RQ_FA_TILE : 1] __attribute__((aligned(32)));
    const uint8_t  * vp[RQ_FA_KB];
    const uint8_t  * kp[RQ_FA_KB]; // the block's packed keys, scored together after the block is gathered
    int              ku[RQ_FA_KB];
#if defined(RQ_HAVE_AVX512_FA)
    // keys scored in integers (AVX-512 VNNI) where the CPU can and the block is 128 wide, values in bf16 pairs
    const bool       avx512 = ggml_rq_cpu_get_avx512() && iso_has_avx512();
    const bool       vnni = avx512 && k_iso && k_qk == QK_ISO;
    uint16_t         tab16[32];
    if (avx512) {
        iso_cb_bf16(v_bits, v_qk, tab16);
    }
    uint8_t          tab8[64];
    const float      cscale = vnni ? iso_cb_u8(k_bits, tab8) : 0.0f;
    int8_t           Q8[vnni ? DK*RQ_FA_TILE : 1] __attribute__((aligned(64)));
    float            SC[vnni ? DK/QK_ISO : 1][RQ_FA_TILE];
    int32_t          BI[vnni ? DK/QK_ISO : 1][RQ_FA_TILE];
    if (avx512 && ir1 > ir0) {
        ggml_rq_counter_add(GGML_RQ_ISO_AVX512_CALLS, 1);
    }
#else
    const bool       avx512 = false;
    const uint16_t * tab16  = NULL;
#endif
#else
    // the current key, and the block's values, unpacked once for the tile
    float kc[k_iso ? DK : 1], kd[k_iso ? DK/k_qk : 1];
    float vc[RQ_FA_KB][DV], vd[RQ_FA_KB][DV/v_qk];
#endif
#if !defined(__AVX2__)
    float sc[RQ_FA_TILE][RQ_FA_KB];
#endif
    // exact keys: the raw query rows, the values accumulated unrotated, the block's exact values and both kinds' weights
    const float * QR[RQ_FA_TILE];
    float VKX[RQ_FA_TILE][xrows ? DV : 1], VKXt[RQ_FA_TILE][xrows ? DV : 1];
    const int64_t rec = 2 + DV + (xrows ? DV : 0); // a row's record in part
    float kx[xrows ? DK : 1], vx[xrows ? RQ_FA_KB : 1][xrows ? DV : 1];
#if defined(__AVX2__)
    float wc[RQ_FA_KB][RQ_FA_TILE];
#else
    float wc[RQ_FA_TILE][RQ_FA_KB], wx[RQ_FA_TILE][RQ_FA_KB];
#endif
    bool  is_x[RQ_FA_KB];

    // Rows are taken heads-fastest (r = (iq3*neq1 + iq1)*neq2 + iq2), and a tile is the query heads of one token
    // that share a K/V head and a mask row. Each row then sees its own visible keys, in cell order, in blocks of
    // RQ_FA_KB: which cells a sequence holds, or who shares the ubatch or the tile, changes neither its blocks nor
    // its float order, so a sequence decodes the same alone or in a unified cache with others.
    for (int64_t ir = ir0; ir < ir1; ) {
        int T = 0;
        int64_t ik2 = 0, ik3 = 0, iv2 = 0, iv3 = 0;
        int32_t qp = 0; // the tile's query position (one token)
        const ggml_fp16_t * mp = NULL;
        for (int t = 0; t < RQ_FA_TILE; ++t) {
            slope[t] = 0.0f; // the lanes of absent rows (the AVX2 softmax reads all eight)
            M[t]     = 0.0f;
        }
        for (; T < RQ_FA_TILE && ir + T < ir1; ++T) {
            const int64_t r   = ir + T;
            const int64_t iq3 = r/(neq1*neq2);
            const int64_t iq1 = (r - iq3*neq1*neq2)/neq2;
            const int64_t iq2 = r - iq3*neq1*neq2 - iq1*neq2;
            const ggml_fp16_t * mpt = mask ? (const ggml_fp16_t *)((const char *) mask->data + iq1*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : NULL;
            if (T == 0) {
                ik2 = iq2/rk2; ik3 = iq3/rk3; iv2 = iq2/rv2; iv3 = iq3/rv3;
                mp = mpt;
                qp = qpos ? qpos[iq3*neq1 + iq1] : 0;
            } else if (iq2/rk2 != ik2 || iq3/rk3 != ik3 || iq2/rv2 != iv2 || iq3/rv3 != iv3 || mpt != mp ||
                       (qpos && (iq1 != row[0][0] || iq3 != row[0][2]))) {
                break;
            }
            row[T][0] = iq1; row[T][1] = iq2; row[T][2] = iq3;
            const uint32_t h = iq2;
            slope[T] = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;
            Mt[T] = -INFINITY;
            St[T] = 0.0f;
            memset(VKQt[T], 0, DV*sizeof(float));
            if (xrows) {
                memset(VKXt[T], 0, DV*sizeof(float));
                QR[T] = (const float *) ((const char *) q->data + (iq1*nbq1 + iq2*nbq2 + iq3*nbq3));
            }
            q_to_vec_dot((const float *) ((const char *) q->data + (iq1*nbq1 + iq2*nbq2 + iq3*nbq3)), Q32[T], DK);
        }
#if defined(__AVX2__)
        if (k_iso) {
#if defined(RQ_HAVE_AVX512_FA)
            if (vnni) {
                iso_q8_tile(T, DK, k_bits, Q32[0], Q32[1] - Q32[0], cscale, Q8, SC, BI);
            } else
#endif
            iso_q_interleave(T, DK, Q32[0], Q32[1] - Q32[0], QI);
        }
#endif

        GGML_ASSERT(!part || T == ir1 - ir0); // the split path hands over one tile at a time
        int64_t ic = ic0;
        for (int64_t ch = c0; ch < c1 && ic < nek1; ++ch) {
            for (int t = 0; t < T; ++t) {
                M[t] = -INFINITY;
                S[t] = 0.0f;
                memset(VKQ[t], 0, DV*sizeof(float));
                if (xrows) {
                    memset(VKX[t], 0, DV*sizeof(float));
                }
            }
            // the next RQ_FA_KB visible keys: scores of every row first, then one online-softmax update per row
            // (vector exp, at most one rescale of VKQ), then V accumulated from the block's values
            for (int64_t nv = 0; nv < RQ_FA_CHUNK && ic < nek1; ) {
                int nu = 0, nc = 0, nx = 0; // keys in the block: all, packed, exact
#if defined(__AVX2__)
                int nk = 0;                 // packed keys whose scores wait for iso_score_rows
#endif
                float raw[RQ_FA_KB][RQ_FA_TILE], mkv[RQ_FA_KB]; // rows' raw scores, mask values
                for (; ic < nek1 && nu < RQ_FA_KB; ++ic) {
                    const float mk = mp ? GGML_CPU_FP16_TO_FP32(mp[ic]) : 0.0f;
                    if (mk == -INFINITY) {
                        continue;
                    }
                    const char * k_data = (const char *) k->data + (ic*nbk1 + ik2*nbk2 + ik3*nbk3);
                    const char * v_data = (const char *) v->data + (ic*nbv1 + iv2*nbv2 + iv3*nbv3);
                    const int32_t xr = xrows && (!xuntil || qp <= xuntil[ik3*nek1 + ic]) ? xrows[ik3*nek1 + ic] : -1;
                    float * s = raw[nu]; // rows t < T; packed keys' scores are written later, all lanes
                    is_x[nu] = xr >= 0;
                    if (xr >= 0 || !k_iso) {
                        memset(s, 0, sizeof(raw[nu])); // the lanes of absent rows stay finite
                    }
                    if (xr >= 0) {
                        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) ((const char *) k_x->data + xr*k_x->nb[1]) + ik2*DK, kx, DK);
                        for (int t = 0; t < T; ++t) {
                            ggml_vec_dot_f32(DK, &s[t], 0, kx, 0, QR[t], 0, 1);
                        }
                        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) ((const char *) v_x->data + xr*v_x->nb[1]) + iv2*DV, vx[nx++], DV);
                    } else if (k_iso) {
#if defined(__AVX2__)
                        kp[nk] = (const uint8_t *) k_data;
                        ku[nk++] = nu;
#else
                        iso_unpack(DK, k_data, kc, kd, k_bits, k_qk);
                        iso_dot_rows(T, DK, kc, kd, Q32[0], Q32[1] - Q32[0], k_qk, s);
#endif
                    } else {
                        for (int t = 0; t < T; ++t) {
                            kq_vec_dot(DK, &s[t], 0, k_data, 0, Q32[t], 0, 1);
                        }
                    }
                    if (xr < 0) {
#if defined(__AVX2__)
                        vp[nc++] = (const uint8_t *) v_data;
#else
                        iso_unpack(DV, v_data, vc[nc], vd[nc], v_bits, v_qk);
                        nc++;
#endif
                    }
                    mkv[nu++] = mk;
                }
                if (nu == 0) {
                    break;
                }
                nv += nu;
#if defined(__AVX2__)
                if (nk > 0) {
#if defined(RQ_HAVE_AVX512_FA)
                    if (vnni) {
                        iso_score_rows_vnni(T, nk, DK, kp, ku, Q8, (const float (*)[RQ_FA_TILE]) SC,
                                            (const int32_t (*)[RQ_FA_TILE]) BI, tab8, k_bits, raw);
                    } else
#endif
                    iso_score_rows(T, nk, DK, kp, ku, QI, &Lk, k_bits, k_qk, raw);
                }
                // the block's online-softmax update with the tile's rows in the lanes: a key's scaled, biased scores, the
                // block max, exps and sums of all rows at once; each lane's arithmetic is its row's alone, so a row's
                // result does not depend on the tile it is in. The weights overwrite the scores in place, [key][row].
                {
                    if (logit_softcap != 0.0f) {
                        for (int u = 0; u < nu; ++u) {
                            for (int t = 0; t < T; ++t) {
                                raw[u][t] = logit_softcap*tanhf(raw[u][t]*scale);
                            }
                        }
                    }
                    const __m256 vsc = _mm256_set1_ps(logit_softcap != 0.0f ? 1.0f : scale);
                    const __m256 vsl = _mm256_loadu_ps(slope);
                    __m256 bm = _mm256_set1_ps(-INFINITY);
                    for (int u = 0; u < nu; ++u) {
                        const __m256 x = _mm256_fmadd_ps(vsl, _mm256_set1_ps(mkv[u]), _mm256_mul_ps(_mm256_loadu_ps(raw[u]), vsc));
                        _mm256_storeu_ps(raw[u], x);
                        bm = _mm256_max_ps(bm, x);
                    }
                    float bmx[RQ_FA_TILE];
                    _mm256_storeu_ps(bmx, bm);
                    for (int t = 0; t < T; ++t) {
                        if (bmx[t] > M[t]) {
                            const float ms = iso_expf_ftz(M[t] - bmx[t]); // 0 on the row's first block
                            ggml_vec_scale_f32(DV, VKQ[t], ms);
                            if (xrows) {
                                ggml_vec_scale_f32(DV, VKX[t], ms);
                            }
                            S[t] *= ms;
                            M[t] = bmx[t];
                        }
                    }
                    const __m256 vm = _mm256_loadu_ps(M);
                    __m256 vs = _mm256_setzero_ps();
                    for (int u = 0; u < nu; ++u) {
                        const __m256 e = iso_exp8_ftz(_mm256_sub_ps(_mm256_loadu_ps(raw[u]), vm));
                        vs = _mm256_add_ps(vs, e);
                        _mm256_storeu_ps(raw[u], e);
                    }
                    float sum[RQ_FA_TILE];
                    _mm256_storeu_ps(sum, vs);
                    for (int t = 0; t < T; ++t) {
                        S[t] += sum[t];
                    }
                }
                if (nx == 0) {
                    iso_mad_rows_any(avx512, T, nu, DV, VKQ[0], VKQ[1] - VKQ[0], vp, (const float (*)[RQ_FA_TILE]) raw, &Lv, tab16, v_bits, v_qk);
                    continue;
                }
                for (int u = 0, jc = 0, jx = 0; u < nu; ++u) {
                    if (is_x[u]) {
                        for (int t = 0; t < T; ++t) {
                            ggml_vec_mad_f32(DV, VKX[t], vx[jx], raw[u][t]);
                        }
                        jx++;
                    } else {
                        memcpy(wc[jc++], raw[u], sizeof(wc[0]));
                    }
                }
                if (nc > 0) {
                    iso_mad_rows_any(avx512, T, nc, DV, VKQ[0], VKQ[1] - VKQ[0], vp, (const float (*)[RQ_FA_TILE]) wc, &Lv, tab16, v_bits, v_qk);
                }
#else
                for (int u = 0; u < nu; ++u) {
                    for (int t = 0; t < T; ++t) {
                        float x = raw[u][t]*scale;
                        if (logit_softcap != 0.0f) {
                            x = logit_softcap*tanhf(x);
                        }
                        sc[t][u] = x + slope[t]*mkv[u];
                    }
                }
                for (int t = 0; t < T; ++t) {
                    float bmax = -INFINITY;
                    for (int u = 0; u < nu; ++u) {
                        bmax = MAX(bmax, sc[t][u]);
                    }
                    if (bmax > M[t]) {
                        const float ms = iso_expf_ftz(M[t] - bmax); // 0 on the row's first block
                        ggml_vec_scale_f32(DV, VKQ[t], ms);
                        if (xrows) {
                            ggml_vec_scale_f32(DV, VKX[t], ms);
                        }
                        S[t] *= ms;
                        M[t] = bmax;
                    }
                    S[t] += (float) ggml_vec_soft_max_f32(nu, sc[t], sc[t], M[t]);
                }
                if (nx == 0) {
                    iso_mad_rows(T, nu, DV, VKQ[0], VKQ[1] - VKQ[0], vc[0], vd[0], (const float (*)[RQ_FA_KB]) sc, v_qk);
                    continue;
                }
                for (int t = 0; t < T; ++t) {
                    for (int u = 0, jc = 0, jx = 0; u < nu; ++u) {
                        if (is_x[u]) {
                            wx[t][jx++] = sc[t][u];
                        } else {
                            wc[t][jc++] = sc[t][u];
                        }
                    }
                    for (int j = 0; j < nx; ++j) {
                        ggml_vec_mad_f32(DV, VKX[t], vx[j], wx[t][j]);
                    }
                }
                if (nc > 0) {
                    iso_mad_rows(T, nc, DV, VKQ[0], VKQ[1] - VKQ[0], vc[0], vd[0], (const float (*)[RQ_FA_KB]) wc, v_qk);
                }
#endif
            }

            for (int t = 0; t < T; ++t) {
                if (part) {
                    float * r = part + (ch*T + t)*rec;
                    r[0] = M[t];
                    r[1] = S[t];
                    memcpy(r + 2, VKQ[t], DV*sizeof(float));
                    if (xrows) {
                        memcpy(r + 2 + DV, VKX[t], DV*sizeof(float));
                    }
                } else {
                    iso_fa_fold(DV, xrows, &Mt[t], &St[t], VKQt[t], VKXt[t], M[t], S[t], VKQ[t], VKX[t]);
                }
            }
        }

        for (int t = 0; t < T && !part; ++t) {
            iso_fa_finish(dst, row[t], DV, v_qk, Mt[t], St[t], VKQt[t], xrows ? VKXt[t] : NULL);
        }
        ir += T;
    }
    GGML_UNUSED(params);
}

void ggml_rq_fa_iso_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    iso_fa_rows(params, dst, ir0, ir1, 0, INT64_MAX, 0, NULL);
}

bool ggml_rq_fa_iso_split(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * q    = dst->src[0];
    const struct ggml_tensor * k    = dst->src[1];
    const struct ggml_tensor * v    = dst->src[2];
    const struct ggml_tensor * mask = dst->src[3];
    const int ith = params->ith;
    const int nth = params->nth;
    if (nth < 2 || q->ne[1] != 1 || q->ne[3] != 1 || (mask && mask->ne[2] != 1) || !ggml_rq_cpu_get_split()) {
        return false; // one token of one sequence, one mask row for all heads
    }
    // the tiles iso_fa_rows makes of the heads: a K/V head's query heads, at most RQ_FA_TILE
    const int64_t nh = q->ne[2], rk2 = nh/k->ne[2], rv2 = nh/v->ne[2];
    int64_t tile[RQ_FA_TILE + 1];
    int nt = 0;
    for (int64_t r = 0; r < nh; ++r) {
        if (nt == 0 || r - tile[nt - 1] == RQ_FA_TILE || r/rk2 != tile[nt - 1]/rk2 || r/rv2 != tile[nt - 1]/rv2) {
            if (nt == RQ_FA_TILE || nt + 1 >= nth) {
                return false; // enough tiles for every thread: iso_fa_rows over the rows
            }
            tile[nt++] = r;
        }
    }
    tile[nt] = nh;
    // the row's visible keys, and the threads per tile: each takes a run of its chunks
    const int64_t nek1 = k->ne[1];
    const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *) mask->data : NULL;
    int64_t nvis = nek1;
    if (mp) {
        nvis = 0;
        for (int64_t ic = 0; ic < nek1; ++ic) {
            nvis += GGML_CPU_FP16_TO_FP32(mp[ic]) != -INFINITY;
        }
    }
    const int64_t nch = (nvis + RQ_FA_CHUNK - 1)/RQ_FA_CHUNK;
    const int64_t DV  = v->ne[0];
    const int64_t rec = 2 + DV + (dst->src[7] ? DV : 0);
    const int64_t np  = MIN(nth/nt, nch);
    if (np < 2 || (size_t) (nt*nch*RQ_FA_TILE*rec)*sizeof(float) > params->wsize) {
        return false;
    }
    if (ith == 0) {
        ggml_rq_counter_add(GGML_RQ_ISO_SPLIT_CALLS, 1);
    }
    float * part = (float *) params->wdata;
    const int j = ith/np, p = ith % np;
    if (j < nt) {
        const int64_t c0 = p*nch/np, c1 = (p + 1)*nch/np;
        int64_t ic0 = 0;
        for (int64_t nv = 0; mp && nv < c0*RQ_FA_CHUNK; ++ic0) {
            nv += GGML_CPU_FP16_TO_FP32(mp[ic0]) != -INFINITY;
        }
        if (!mp) {
            ic0 = c0*RQ_FA_CHUNK;
        }
        iso_fa_rows(params, dst, tile[j], tile[j + 1], c0, c1, ic0, part + j*nch*RQ_FA_TILE*rec);
    }
    ggml_barrier(params->threadpool);
    // each tile's chunks folded in order, as iso_fa_rows folds them: the same bits as without the split
    if (ith < nt) {
        const float * pt = part + ith*nch*RQ_FA_TILE*rec;
        const int T = (int) (tile[ith + 1] - tile[ith]);
        float vkq[DV], vkx[DV];
        for (int t = 0; t < T; ++t) {
            float m = -INFINITY, s = 0.0f;
            memset(vkq, 0, sizeof(vkq));
            memset(vkx, 0, sizeof(vkx));
            for (int64_t ch = 0; ch < nch; ++ch) {
                const float * r = pt + (ch*T + t)*rec;
                iso_fa_fold(DV, rec > 2 + DV, &m, &s, vkq, vkx, r[0], r[1], r + 2, r + 2 + DV);
            }
            const int64_t row[3] = { 0, tile[ith] + t, 0 };
            iso_fa_finish(dst, row, DV, ggml_rq_iso_qk(v->type), m, s, vkq, rec > 2 + DV ? vkx : NULL);
        }
    }
    return true;
}

void ggml_rq_fa_count(enum ggml_type type_k, enum ggml_type type_v, bool use_ref) {
    if (ggml_rq_type_is_iso(type_k) || ggml_rq_type_is_iso(type_v)) {
        ggml_rq_counter_add(use_ref ? GGML_RQ_ISO_FALLBACK_CALLS : GGML_RQ_ISO_FUSED_CALLS, 1);
    }
}

// ---------------------------------------------------------------------------------------------
// ITQ3_S x Q8_ITQ: both sides are in the rotated domain, so the dot product is a plain integer dot
// against the grid values: sum_b dx * (d * sum_i grid[q_i] qx_i + m * sum_i qx_i)

void quantize_row_itq3_s(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_itq3_s_ref(x, (block_itq3_s *) y, k);
}

#if defined(__AVX2__)
// stages h = 1, 2, 4 of the WHT inside one register: lanes j (bit h clear) get a + b, lanes j + h get a - b,
// the same additions as ggml_rq_wht (bit-identical)
static inline __m256 rq_wht8(__m256 v) {
    __m256 p = _mm256_permute_ps(v, 0xb1);
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xaa);
    p = _mm256_permute_ps(v, 0x4e);
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xcc);
    p = _mm256_permute2f128_ps(v, v, 1);
    return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xf0);
}

// ggml_rq_itq3_rotate (signs, FWHT-256, * 1/16), bit-identical: stages h >= 8 pair whole registers
static void rq_itq3_rotate(const float * GGML_RESTRICT x, float * GGML_RESTRICT t) {
    __m256 v[QK_ITQ/8];
    for (int i = 0; i < QK_ITQ/8; ++i) {
        v[i] = rq_wht8(_mm256_mul_ps(_mm256_loadu_ps(x + 8*i), _mm256_loadu_ps(itq3_signs + 8*i)));
    }
    for (int h = 1; h < QK_ITQ/8; h <<= 1) {
        for (int i = 0; i < QK_ITQ/8; i += 2*h) {
            for (int j = i; j < i + h; ++j) {
                const __m256 a = v[j], b = v[j + h];
                v[j]     = _mm256_add_ps(a, b);
                v[j + h] = _mm256_sub_ps(a, b);
            }
        }
    }
    const __m256 sc = _mm256_set1_ps(0.0625f);
    for (int i = 0; i < QK_ITQ/8; ++i) {
        _mm256_storeu_ps(t + 8*i, _mm256_mul_ps(v[i], sc));
    }
}
#else
#define rq_itq3_rotate ggml_rq_itq3_rotate
#endif

void quantize_row_q8_itq(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ITQ == 0);
    float t[QK_ITQ];
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        rq_itq3_rotate(x + ib*QK_ITQ, t);
        ggml_rq_quantize_q7_K(t, (block_q8_K *) y + ib);
    }
}

// one block's 256 codes as u = grid[q] + 127 in [0, 254], in element order, for ggml-cpu's tiled matmul
// (rq-tiled.h), which multiplies them against many activation columns, so the unpack is paid once per tile
void ggml_rq_itq3_codes(const void * GGML_RESTRICT vx, uint8_t * GGML_RESTRICT dst) {
    const block_itq3_s * GGML_RESTRICT x = vx;
#if defined(__AVX2__)
    // the vec_dot's chunk layout (codes 32c..32c+31) with a table of grid + 127
    const __m256i gtab = _mm256_broadcastsi128_si256(_mm_add_epi8(_mm_loadl_epi64((const __m128i *) itq3_grid),
                                                                  _mm_set1_epi8(127)));
    const __m256i m3   = _mm256_set1_epi8(3);
    const __m256i m4   = _mm256_set1_epi8(4);
    const __m256i lo0  = _mm256_loadu_si256((const __m256i *) (x->qs +  0));
    const __m256i lo1  = _mm256_loadu_si256((const __m256i *) (x->qs + 32));
    const __m256i hi   = _mm256_loadu_si256((const __m256i *) x->qh);
#define RQ_ITQ3_CODES(c, l, h) _mm256_storeu_si256((__m256i *) (dst + 32*(c)), \
        _mm256_shuffle_epi8(gtab, _mm256_or_si256(_mm256_and_si256(l, m3), _mm256_and_si256(h, m4))))
    RQ_ITQ3_CODES(0, lo0,                         _mm256_slli_epi16(hi, 2));
    RQ_ITQ3_CODES(1, lo1,                         _mm256_slli_epi16(hi, 1));
    RQ_ITQ3_CODES(2, _mm256_srli_epi16(lo0, 2), hi);
    RQ_ITQ3_CODES(3, _mm256_srli_epi16(lo1, 2), _mm256_srli_epi16(hi, 1));
    RQ_ITQ3_CODES(4, _mm256_srli_epi16(lo0, 4), _mm256_srli_epi16(hi, 2));
    RQ_ITQ3_CODES(5, _mm256_srli_epi16(lo1, 4), _mm256_srli_epi16(hi, 3));
    RQ_ITQ3_CODES(6, _mm256_srli_epi16(lo0, 6), _mm256_srli_epi16(hi, 4));
    RQ_ITQ3_CODES(7, _mm256_srli_epi16(lo1, 6), _mm256_srli_epi16(hi, 5));
#undef RQ_ITQ3_CODES
#else
    for (int i = 0; i < QK_ITQ; ++i) {
        const int q = ((x->qs[i & 63] >> (2*(i >> 6))) & 3) | (((x->qh[i & 31] >> (i >> 5)) & 1) << 2);
        dst[i] = (uint8_t) (itq3_grid[q] + 127);
    }
#endif
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
    // grid lookup with pshufb (8 entries, both lanes); |g| x sign(x, g) keeps maddubs in range (|g|, |x| <= 127).
    // Code i of chunk c (codes 32c..32c+31, t = i - 32c): low bits qs[32*(c&1) + t] >> 2*(c>>1), high bit
    // qh[t] >> c, moved to bit 2 by one 16-bit shift (c < 2 left, c > 2 right; the mask drops what crosses bytes).
    // Per block the integer sums go to float lanes with one fmadd each (no horizontal add until the end),
    // the offset term from the 16 bsums in one madd.
    const __m256i gtab = _mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i *) grid));
    const __m256i m3   = _mm256_set1_epi8(3);
    const __m256i m4   = _mm256_set1_epi8(4);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 accd = _mm256_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
#define RQ_ITQ3_DOT(acc, c, l, h) do { \
        const __m256i g_  = _mm256_shuffle_epi8(gtab, _mm256_or_si256(_mm256_and_si256(l, m3), _mm256_and_si256(h, m4))); \
        const __m256i q8_ = _mm256_loadu_si256((const __m256i *) (q8 + 32*(c))); \
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(g_, g_), _mm256_sign_epi8(q8_, g_)), ones)); \
    } while (0)
    for (int ib = 0; ib < nb; ++ib) {
        const int8_t * GGML_RESTRICT q8 = y[ib].qs;
        const __m256i lo0 = _mm256_loadu_si256((const __m256i *) (x[ib].qs +  0));
        const __m256i lo1 = _mm256_loadu_si256((const __m256i *) (x[ib].qs + 32));
        const __m256i hi  = _mm256_loadu_si256((const __m256i *) x[ib].qh);
        __m256i acc0 = _mm256_setzero_si256();
        __m256i acc1 = _mm256_setzero_si256();
        RQ_ITQ3_DOT(acc0, 0, lo0,                         _mm256_slli_epi16(hi, 2));
        RQ_ITQ3_DOT(acc1, 1, lo1,                         _mm256_slli_epi16(hi, 1));
        RQ_ITQ3_DOT(acc0, 2, _mm256_srli_epi16(lo0, 2), hi);
        RQ_ITQ3_DOT(acc1, 3, _mm256_srli_epi16(lo1, 2), _mm256_srli_epi16(hi, 1));
        RQ_ITQ3_DOT(acc0, 4, _mm256_srli_epi16(lo0, 4), _mm256_srli_epi16(hi, 2));
        RQ_ITQ3_DOT(acc1, 5, _mm256_srli_epi16(lo1, 4), _mm256_srli_epi16(hi, 3));
        RQ_ITQ3_DOT(acc0, 6, _mm256_srli_epi16(lo0, 6), _mm256_srli_epi16(hi, 4));
        RQ_ITQ3_DOT(acc1, 7, _mm256_srli_epi16(lo1, 6), _mm256_srli_epi16(hi, 5));
        const __m256i qsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) y[ib].bsums), ones);
        accd = _mm256_fmadd_ps(_mm256_set1_ps(y[ib].d*GGML_CPU_FP16_TO_FP32(x[ib].d)),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(acc0, acc1)), accd);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(y[ib].d*GGML_CPU_FP16_TO_FP32(x[ib].m)), _mm256_cvtepi32_ps(qsum), accm);
    }
#undef RQ_ITQ3_DOT
    *s = hsum_f32_8(_mm256_add_ps(accd, accm));
#elif defined(RQ_NEON)
    // grid lookup with tbl (8 entries); 16 codes per register, integer dot (sdot where the CPU has it)
    const int8x16_t  gtab = vcombine_s8(vld1_s8(grid), vld1_s8(grid));
    const uint8x16_t m3   = vdupq_n_u8(3);
    const uint8x16_t m1   = vdupq_n_u8(1);
    float sumf = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        const ggml_uint8x16x4_t lo = ggml_vld1q_u8_x4(x[ib].qs);
        const ggml_uint8x16x2_t hi = ggml_vld1q_u8_x2(x[ib].qh);
        int32x4_t acc = vdupq_n_s32(0);
        for (int c = 0; c < 8; ++c) {
            const int8x16_t sl = vdupq_n_s8(-2*(c >> 1));
            const int8x16_t sh = vdupq_n_s8(-c);
            for (int h = 0; h < 2; ++h) {
                // codes 32c+16h+t: low bits from qs[32*(c&1) + 16h + t] >> 2*(c>>1), high bit from qh[16h + t] >> c
                const uint8x16_t l   = vandq_u8(vshlq_u8(lo.val[2*(c & 1) + h], sl), m3);
                const uint8x16_t b   = vandq_u8(vshlq_u8(hi.val[h], sh), m1);
                const int8x16_t  g   = ggml_vqtbl1q_s8(gtab, vorrq_u8(l, vshlq_n_u8(b, 2)));
                acc = ggml_vdotq_s32(acc, g, vld1q_s8(y[ib].qs + 32*c + 16*h));
            }
        }
        const int32_t isum = vaddvq_s32(acc);
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
