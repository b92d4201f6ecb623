// RotaryQuant fused attention, AVX-512 kernels (VNNI keys, BF16 values) for x86-64-v3 builds on CPUs that have them
// (Zen 4, Sapphire Rapids): each function carries its own target attribute, and ggml_rq_fa_avx512_init checks the
// CPU once, so one build runs everywhere. The softmax is the AVX2 kernels'.

#include "../../rq-cpu-impl.h"

#if defined(RQ_HAVE_AVX512_FA)
#include <immintrin.h>

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

// the int8 codebook as vpermb's 64-byte table (levels repeated: index bits above the width are don't-care) and its
// scale. The outer level L <= 127 is the one whose rounding moves the levels least: 3-bit, L = 113 gives 13/40/71/113,
// 0.11% rms off the codebook where L = 127 is 0.37% (its inner level 14.6 -> 15 alone 3%); that rounding is a fixed
// error of every key's score, as large as the int8 query's (numpy, 2026-12-04). 4-bit: L = 112, 0.29% vs 0.30%.
// Found once per width, at init: the search is 64 x 16 roundings.
static int iso_cb_top(int bits, const float * cb, float cmax) {
    double emin = INFINITY;
    int    top  = 127;
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

// the tables, by index width (and block width for the bf16 codebook): built once by ggml_rq_fa_avx512_init
static uint8_t  rq_tab8[5][64];
static float    rq_cscale[5];
static uint16_t rq_tab16[5][2][32];

static bool fa_k_int8(const struct rq_fa_op * op) {
    return op->k_bits != 0 && op->k_qk == QK_ISO; // keys scored in integers: 128-value blocks only
}

static void fa_q_tile_avx512(const struct rq_fa_op * op, int T, const float * q, int64_t q_stride, struct rq_fa_qtile * qt) {
    if (!fa_k_int8(op)) {
        ggml_rq_fa_kernels_avx2.q_tile(op, T, q, q_stride, qt);
        return;
    }
    iso_q8_tile(T, op->dk, op->k_bits, q, q_stride, rq_cscale[op->k_bits], qt->q8, qt->sc, qt->bias);
}

static void fa_score_avx512(const struct rq_fa_op * op, const struct rq_fa_qtile * qt, int T, int nk,
                            const uint8_t * const * xs, const int * us, float (*raw)[RQ_FA_TILE]) {
    if (!fa_k_int8(op)) {
        ggml_rq_fa_kernels_avx2.score(op, qt, T, nk, xs, us, raw);
        return;
    }
    iso_score_rows_vnni(T, nk, op->dk, xs, us, qt->q8, (const float (*)[RQ_FA_TILE]) qt->sc,
                        (const int32_t (*)[RQ_FA_TILE]) qt->bias, rq_tab8[op->k_bits], op->k_bits, raw);
}

static void fa_mad_avx512(const struct rq_fa_op * op, int T, int nu, float * vkq, int64_t vkq_stride,
                          const uint8_t * const * vx, const float (*w)[RQ_FA_TILE]) {
    iso_mad_rows_bf16(T, nu, op->dv, vkq, vkq_stride, vx, w, rq_tab16[op->v_bits][op->v_qk == QK_ISO ? 0 : 1], op->v_bits, op->v_qk);
}

static void fa_softmax_avx512(int T, int nu, float (*raw)[RQ_FA_TILE], const float * mk, const float * slope, float scale,
                              float softcap, float * M, float * S, float * ms) {
    ggml_rq_fa_kernels_avx2.softmax(T, nu, raw, mk, slope, scale, softcap, M, S, ms);
}

const struct rq_fa_kernels ggml_rq_fa_kernels_avx512 = {
    /* .q_tile  = */ fa_q_tile_avx512,
    /* .score   = */ fa_score_avx512,
    /* .softmax = */ fa_softmax_avx512,
    /* .mad     = */ fa_mad_avx512,
    /* .counter = */ GGML_RQ_ISO_AVX512_CALLS,
};

// libgcc's check includes the OS saving the 512-bit state
bool ggml_rq_fa_avx512_init(void) {
    __builtin_cpu_init();
    const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni") &&
                    __builtin_cpu_supports("avx512bf16");
    if (ok) {
        for (int bits = 3; bits <= 4; ++bits) {
            rq_cscale[bits] = iso_cb_u8(bits, rq_tab8[bits]);
            iso_cb_bf16(bits, QK_ISO,   rq_tab16[bits][0]);
            iso_cb_bf16(bits, QK_ISO64, rq_tab16[bits][1]);
        }
    }
    return ok;
}

#endif // RQ_HAVE_AVX512_FA
