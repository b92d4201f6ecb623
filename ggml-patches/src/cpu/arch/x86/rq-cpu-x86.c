// RotaryQuant CPU kernels for x86: AVX2 (the x86-64-v3 build; a build without AVX2 runs the portable twins), and the
// choice, once, between these attention kernels and the AVX-512 ones (rq-fa-avx512.c).

#include "../../rq-cpu-impl.h"
#include "ggml-rq/itq3-tables.h"

#include <assert.h>

#if defined(RQ_ARCH_X86)

#if defined(__AVX2__)
#include <immintrin.h>

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

// sum_b ||x_b|| * <c[idx_b], (R q)_b> for `bits`-bit IsoQuant blocks of qk values; y: the rotated query
RQ_INLINE float iso_vec_dot(int n, const void * GGML_RESTRICT vx, const float * GGML_RESTRICT y, int bits, int qk) {
    const int nb = n / qk;
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
}

#define ISO_VEC_DOT(name, qname, bits, qk)                                                                            \
void ggml_vec_dot_##name##_##qname(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                                   const void * GGML_RESTRICT vy, size_t by, int nrc) {                               \
    assert(nrc == 1 && n % (qk) == 0);                                                                                \
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);                                              \
    *s = iso_vec_dot(n, vx, (const float *) vy, bits, qk);                                                            \
}
#else
#define ISO_VEC_DOT(name, qname, bits, qk)                                                                            \
void ggml_vec_dot_##name##_##qname(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                                   const void * GGML_RESTRICT vy, size_t by, int nrc) {                               \
    ggml_vec_dot_##name##_##qname##_generic(n, s, bs, vx, bx, vy, by, nrc);                                           \
}
#endif

ISO_VEC_DOT(isoquant3_0,  isoq_q,   3, QK_ISO)
ISO_VEC_DOT(isoquant4_0,  isoq_q,   4, QK_ISO)
ISO_VEC_DOT(isoquant3_64, isoq_q64, 3, QK_ISO64)
ISO_VEC_DOT(isoquant4_64, isoq_q64, 4, QK_ISO64)
#undef ISO_VEC_DOT

#if defined(__AVX2__)
// ---------------------------------------------------------------------------------------------
// fused attention: packed keys and values read in place, the query tile interleaved, the tile's rows in the lanes

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

static void fa_q_tile_avx2(const struct rq_fa_op * op, int T, const float * q, int64_t q_stride, struct rq_fa_qtile * qt) {
    iso_q_interleave(T, op->dk, q, q_stride, qt->qi);
}

static void fa_score_avx2(const struct rq_fa_op * op, const struct rq_fa_qtile * qt, int T, int nk,
                          const uint8_t * const * xs, const int * us, float (*raw)[RQ_FA_TILE]) {
    const iso_lut L = iso_lut_init(op->k_bits, op->k_qk);
    iso_score_rows(T, nk, op->dk, xs, us, qt->qi, &L, op->k_bits, op->k_qk, raw);
}

// the block's online softmax with the tile's rows in the lanes: a key's scaled, biased scores, the block max, exps and
// sums of all rows at once; each lane's arithmetic is its row's alone, so a row's result does not depend on the tile
// it is in. The weights overwrite the scores in place, [key][row].
static void fa_softmax_avx2(int T, int nu, float (*raw)[RQ_FA_TILE], const float * mk, const float * slope, float scale,
                            float softcap, float * M, float * S, float * ms) {
    if (softcap != 0.0f) {
        for (int u = 0; u < nu; ++u) {
            for (int t = 0; t < T; ++t) {
                raw[u][t] = softcap*tanhf(raw[u][t]*scale);
            }
        }
    }
    const __m256 vsc = _mm256_set1_ps(softcap != 0.0f ? 1.0f : scale);
    const __m256 vsl = _mm256_loadu_ps(slope);
    __m256 bm = _mm256_set1_ps(-INFINITY);
    for (int u = 0; u < nu; ++u) {
        const __m256 x = _mm256_fmadd_ps(vsl, _mm256_set1_ps(mk[u]), _mm256_mul_ps(_mm256_loadu_ps(raw[u]), vsc));
        _mm256_storeu_ps(raw[u], x);
        bm = _mm256_max_ps(bm, x);
    }
    float bmx[RQ_FA_TILE];
    _mm256_storeu_ps(bmx, bm);
    for (int t = 0; t < RQ_FA_TILE; ++t) {
        ms[t] = 1.0f;
        if (t < T && bmx[t] > M[t]) {
            ms[t] = iso_expf_ftz(M[t] - bmx[t]); // 0 on the row's first block
            S[t] *= ms[t];
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

static void fa_mad_avx2(const struct rq_fa_op * op, int T, int nu, float * vkq, int64_t vkq_stride,
                        const uint8_t * const * vx, const float (*w)[RQ_FA_TILE]) {
    const iso_lut L = iso_lut_init(op->v_bits, op->v_qk);
    iso_mad_rows_packed(T, nu, op->dv, vkq, vkq_stride, vx, w, &L, op->v_bits, op->v_qk);
}

const struct rq_fa_kernels ggml_rq_fa_kernels_avx2 = {
    /* .q_tile  = */ fa_q_tile_avx2,
    /* .score   = */ fa_score_avx2,
    /* .softmax = */ fa_softmax_avx2,
    /* .mad     = */ fa_mad_avx2,
    /* .counter = */ -1,
};
#endif // __AVX2__

void ggml_rq_fa_kernels_init(const struct rq_fa_kernels ** best, const struct rq_fa_kernels ** base) {
#if defined(__AVX2__)
    *base = &ggml_rq_fa_kernels_avx2;
#if defined(RQ_HAVE_AVX512_FA)
    *best = ggml_rq_fa_avx512_init() ? &ggml_rq_fa_kernels_avx512 : *base;
#else
    *best = *base;
#endif
#else
    ggml_rq_fa_kernels_init_generic(best, base);
#endif
}

// ---------------------------------------------------------------------------------------------
// ITQ3_S: the activations' rotation, the tiled matmul's codes, the dot product

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
#endif

void quantize_row_q8_itq(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    assert(k % QK_ITQ == 0);
    float t[QK_ITQ];
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        rq_itq3_rotate(x + ib*QK_ITQ, t);
        ggml_rq_quantize_q7_K(t, (block_q8_K *) y + ib);
    }
#else
    quantize_row_q8_itq_generic(x, y, k);
#endif
}

void ggml_rq_itq3_codes(const void * GGML_RESTRICT vx, uint8_t * GGML_RESTRICT dst) {
#if defined(__AVX2__)
    const block_itq3_s * GGML_RESTRICT x = vx;
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
    ggml_rq_itq3_codes_generic(vx, dst);
#endif
}

void ggml_vec_dot_itq3_s_q8_itq(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
#if defined(__AVX2__)
    assert(nrc == 1);
    assert(n % QK_ITQ == 0);
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);

    const block_itq3_s * GGML_RESTRICT x = vx;
    const block_q8_K   * GGML_RESTRICT y = vy;
    const int nb = n / QK_ITQ;
    const int8_t * grid = itq3_grid;

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
#else
    ggml_vec_dot_itq3_s_q8_itq_generic(n, s, bs, vx, bx, vy, by, nrc);
#endif
}

#endif // RQ_ARCH_X86
