// RotaryQuant CPU kernels for Arm: NEON on AArch64 (table lookups with tbl, integer dots with sdot where the build has
// dotprod); 32-bit Arm and AArch64 without NEON run the portable twins. The attention is the portable driver's
// unpacked path (rq-cpu.c) with the NEON unpack, dot and multiply-add below.

#include "../../rq-cpu-impl.h"
#include "ggml-rq/itq3-tables.h"

#include <assert.h>

#if defined(RQ_ARCH_ARM)

#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define RQ_NEON

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

// sum_b ||x_b|| * <c[idx_b], (R q)_b> for `bits`-bit IsoQuant blocks of qk values; y: the rotated query
RQ_INLINE float iso_vec_dot(int n, const void * GGML_RESTRICT vx, const float * GGML_RESTRICT y, int bits, int qk) {
    const int nb = n / qk;
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
}

#define ISO_VEC_DOT(name, qname, bits, qk)                                                                            \
void ggml_vec_dot_##name##_##qname(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                                   const void * GGML_RESTRICT vy, size_t by, int nrc) {                               \
    assert(nrc == 1 && n % (qk) == 0);                                                                                \
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);                                              \
    *s = iso_vec_dot(n, vx, (const float *) vy, bits, qk);                                                            \
}

// codebook values (unscaled) and block norms of one packed row: computed once per key for all query rows that share it
RQ_INLINE void iso_unpack_bits(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk) {
    const iso_lut L = iso_lut_init(bits, qk);
    for (int ib = 0; ib < n / qk; ++ib) {
        const uint8_t * blk = iso_block(x, ib, bits, qk);
        const uint8_t * qs  = blk + sizeof(ggml_half);
        d[ib] = iso_block_d(blk);
        for (int g = 0; g < qk/8; ++g) {
            const float32x4x2_t v = iso_lookup8(&L, qs, g);
            vst1q_f32(c + ib*qk + 8*g + 0, v.val[0]);
            vst1q_f32(c + ib*qk + 8*g + 4, v.val[1]);
        }
    }
}

void ggml_rq_iso_unpack(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk) {
    if (qk == QK_ISO) {
        if (bits == 3) { iso_unpack_bits(n, x, c, d, 3, QK_ISO);   } else { iso_unpack_bits(n, x, c, d, 4, QK_ISO);   }
    } else {
        if (bits == 3) { iso_unpack_bits(n, x, c, d, 3, QK_ISO64); } else { iso_unpack_bits(n, x, c, d, 4, QK_ISO64); }
    }
}

// iso_vec_dot on an unpacked row: the same operations in the same order
float ggml_rq_iso_dot_unpacked(int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, const float * GGML_RESTRICT q, int qk) {
    float32x4_t acc0 = vdupq_n_f32(0.0f);
    float32x4_t acc1 = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < n / qk; ++ib) {
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
}

// acc += v * ||x_b|| * c[idx_b] in the rotated domain, on an unpacked row
void ggml_rq_iso_mad_unpacked(int n, float * GGML_RESTRICT acc, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, float v, int qk) {
    for (int ib = 0; ib < n / qk; ++ib) {
        const float vd = v*d[ib];
        for (int i = 0; i < qk; i += 4) {
            vst1q_f32(acc + ib*qk + i, vmlaq_n_f32(vld1q_f32(acc + ib*qk + i), vld1q_f32(c + ib*qk + i), vd));
        }
    }
}
#else
#define ISO_VEC_DOT(name, qname, bits, qk)                                                                            \
void ggml_vec_dot_##name##_##qname(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                                   const void * GGML_RESTRICT vy, size_t by, int nrc) {                               \
    ggml_vec_dot_##name##_##qname##_generic(n, s, bs, vx, bx, vy, by, nrc);                                           \
}

void ggml_rq_iso_unpack(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk) {
    ggml_rq_iso_unpack_generic(n, x, c, d, bits, qk);
}

float ggml_rq_iso_dot_unpacked(int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, const float * GGML_RESTRICT q, int qk) {
    return ggml_rq_iso_dot_unpacked_generic(n, c, d, q, qk);
}

void ggml_rq_iso_mad_unpacked(int n, float * GGML_RESTRICT acc, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, float v, int qk) {
    ggml_rq_iso_mad_unpacked_generic(n, acc, c, d, v, qk);
}
#endif

ISO_VEC_DOT(isoquant3_0,  isoq_q,   3, QK_ISO)
ISO_VEC_DOT(isoquant4_0,  isoq_q,   4, QK_ISO)
ISO_VEC_DOT(isoquant3_64, isoq_q64, 3, QK_ISO64)
ISO_VEC_DOT(isoquant4_64, isoq_q64, 4, QK_ISO64)
#undef ISO_VEC_DOT

void ggml_vec_dot_itq3_s_q8_itq(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
#if defined(RQ_NEON)
    assert(nrc == 1);
    assert(n % QK_ITQ == 0);
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);

    const block_itq3_s * GGML_RESTRICT x = vx;
    const block_q8_K   * GGML_RESTRICT y = vy;
    const int nb = n / QK_ITQ;
    const int8_t * grid = itq3_grid;

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
    ggml_vec_dot_itq3_s_q8_itq_generic(n, s, bs, vx, bx, vy, by, nrc);
#endif
}

#endif // RQ_ARCH_ARM
