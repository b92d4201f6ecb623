// RotaryQuant CPU kernels, portable: the reference every SIMD variant (arch/x86, arch/arm) is checked against,
// and what runs where none applies. Also the one-time choice of the attention kernels (ggml_rq_cpu_init).

#include "rq-cpu-impl.h"
#include "ggml-rq/itq3-tables.h"

#include <assert.h>

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

// sum_b ||x_b|| * <c[idx_b], (R q)_b> for `bits`-bit IsoQuant blocks of qk values; y: the rotated query
// (ISOQ_Q / ISOQ_Q64 rows are n plain floats)
RQ_INLINE float iso_vec_dot(int n, const void * GGML_RESTRICT vx, const float * GGML_RESTRICT y, int bits, int qk) {
    const float  * cb   = ggml_rq_iso_codebook_qk(bits, qk);
    const uint32_t mask = (1u << bits) - 1;
    float sumf = 0.0f;
    for (int ib = 0; ib < n / qk; ++ib) {
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
}

#define ISO_VEC_DOT(name, qname, bits, qk)                                                                                       \
void ggml_vec_dot_##name##_##qname##_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                                             const void * GGML_RESTRICT vy, size_t by, int nrc) {                                \
    assert(nrc == 1 && n % (qk) == 0);                                                                                           \
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);                                                         \
    *s = iso_vec_dot(n, vx, (const float *) vy, bits, qk);                                                                       \
}

ISO_VEC_DOT(isoquant3_0,  isoq_q,   3, QK_ISO)
ISO_VEC_DOT(isoquant4_0,  isoq_q,   4, QK_ISO)
ISO_VEC_DOT(isoquant3_64, isoq_q64, 3, QK_ISO64)
ISO_VEC_DOT(isoquant4_64, isoq_q64, 4, QK_ISO64)
#undef ISO_VEC_DOT

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

// ---------------------------------------------------------------------------------------------
// the portable attention: each packed key and value unpacked once into floats, for all rows of the tile

void ggml_rq_iso_unpack_generic(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk) {
    const float  * cb   = ggml_rq_iso_codebook_qk(bits, qk);
    const uint32_t mask = (1u << bits) - 1;
    for (int ib = 0; ib < n / qk; ++ib) {
        const uint8_t * blk    = iso_block(x, ib, bits, qk);
        float         * cb_out = c + ib*qk;
        d[ib] = iso_block_d(blk);
        for (int g = 0; g < qk/8; ++g) {
            const uint32_t w = ggml_rq_iso_word(blk + sizeof(ggml_half), g, bits);
            for (int j = 0; j < 8; ++j) {
                cb_out[8*g + j] = cb[(w >> (bits*j)) & mask];
            }
        }
    }
}

// iso_vec_dot on an unpacked row: the same operations in the same order
float ggml_rq_iso_dot_unpacked_generic(int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, const float * GGML_RESTRICT q, int qk) {
    float sumf = 0.0f;
    for (int ib = 0; ib < n / qk; ++ib) {
        float sum = 0.0f;
        for (int i = 0; i < qk; ++i) {
            sum += c[ib*qk + i] * q[ib*qk + i];
        }
        sumf += sum * d[ib];
    }
    return sumf;
}

// acc += v * ||x_b|| * c[idx_b] in the rotated domain, on an unpacked row
void ggml_rq_iso_mad_unpacked_generic(int n, float * GGML_RESTRICT acc, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, float v, int qk) {
    for (int ib = 0; ib < n / qk; ++ib) {
        const float vd = v*d[ib];
        for (int i = 0; i < qk; ++i) {
            acc[ib*qk + i] += vd * c[ib*qk + i];
        }
    }
}

static void fa_q_tile_generic(const struct rq_fa_op * op, int T, const float * q, int64_t q_stride, struct rq_fa_qtile * qt) {
    GGML_UNUSED(op); GGML_UNUSED(T);
    qt->q        = q;
    qt->q_stride = q_stride;
}

static void fa_score_generic(const struct rq_fa_op * op, const struct rq_fa_qtile * qt, int T, int nk,
                             const uint8_t * const * xs, const int * us, float (*raw)[RQ_FA_TILE]) {
    float kc[RQ_FA_DMAX], kd[RQ_FA_DMAX/QK_ISO64];
    for (int j = 0; j < nk; ++j) {
        ggml_rq_iso_unpack(op->dk, xs[j], kc, kd, op->k_bits, op->k_qk);
        for (int t = 0; t < RQ_FA_TILE; ++t) {
            raw[us[j]][t] = t < T ? ggml_rq_iso_dot_unpacked(op->dk, kc, kd, qt->q + t*qt->q_stride, op->k_qk) : 0.0f;
        }
    }
}

static void fa_softmax_generic(int T, int nu, float (*raw)[RQ_FA_TILE], const float * mk, const float * slope, float scale,
                               float softcap, float * M, float * S, float * ms) {
    float w[RQ_FA_KB];
    for (int t = 0; t < T; ++t) {
        float bmax = -INFINITY;
        for (int u = 0; u < nu; ++u) {
            float x = raw[u][t]*scale;
            if (softcap != 0.0f) {
                x = softcap*tanhf(x);
            }
            w[u] = x + slope[t]*mk[u];
            bmax = MAX(bmax, w[u]);
        }
        ms[t] = 1.0f;
        if (bmax > M[t]) {
            ms[t] = iso_expf_ftz(M[t] - bmax); // 0 on the row's first block
            S[t] *= ms[t];
            M[t] = bmax;
        }
        S[t] += (float) ggml_vec_soft_max_f32(nu, w, w, M[t]);
        for (int u = 0; u < nu; ++u) {
            raw[u][t] = w[u];
        }
    }
    for (int t = T; t < RQ_FA_TILE; ++t) {
        ms[t] = 1.0f;
    }
}

static void fa_mad_generic(const struct rq_fa_op * op, int T, int nu, float * vkq, int64_t vkq_stride,
                           const uint8_t * const * vx, const float (*w)[RQ_FA_TILE]) {
    float vc[RQ_FA_KB][RQ_FA_DMAX], vd[RQ_FA_KB][RQ_FA_DMAX/QK_ISO64];
    for (int u = 0; u < nu; ++u) {
        ggml_rq_iso_unpack(op->dv, vx[u], vc[u], vd[u], op->v_bits, op->v_qk);
    }
    for (int t = 0; t < T; ++t) {
        for (int u = 0; u < nu; ++u) {
            if (w[u][t] != 0.0f) {
                ggml_rq_iso_mad_unpacked(op->dv, vkq + t*vkq_stride, vc[u], vd[u], w[u][t], op->v_qk);
            }
        }
    }
}

const struct rq_fa_kernels ggml_rq_fa_kernels_generic = {
    /* .q_tile  = */ fa_q_tile_generic,
    /* .score   = */ fa_score_generic,
    /* .softmax = */ fa_softmax_generic,
    /* .mad     = */ fa_mad_generic,
    /* .counter = */ -1,
};

void ggml_rq_fa_kernels_init_generic(const struct rq_fa_kernels ** best, const struct rq_fa_kernels ** base) {
    *best = &ggml_rq_fa_kernels_generic;
    *base = &ggml_rq_fa_kernels_generic;
}

// chosen once, before any graph runs (ggml_cpu_init), like ggml-cpu's own feature detection
static const struct rq_fa_kernels * rq_fa_best;
static const struct rq_fa_kernels * rq_fa_base;

void ggml_rq_cpu_init(void) {
    ggml_rq_fa_kernels_init(&rq_fa_best, &rq_fa_base);
}

const struct rq_fa_kernels * ggml_rq_fa_kernels(void) {
    GGML_ASSERT(rq_fa_best && "ggml_cpu_init() has not run");
    return ggml_rq_cpu_get_avx512() ? rq_fa_best : rq_fa_base;
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

void quantize_row_q8_itq_generic(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ITQ == 0);
    float t[QK_ITQ];
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        ggml_rq_itq3_rotate(x + ib*QK_ITQ, t);
        ggml_rq_quantize_q7_K(t, (block_q8_K *) y + ib);
    }
}

// code i of a block: low bits qs[i & 63] >> 2*(i >> 6), high bit qh[i & 31] >> (i >> 5)
static inline int itq3_code(const block_itq3_s * x, int i) {
    return ((x->qs[i & 63] >> (2*(i >> 6))) & 3) | (((x->qh[i & 31] >> (i >> 5)) & 1) << 2);
}

// one block's 256 codes as u = grid[q] + 127 in [0, 254], in element order, for ggml-cpu's tiled matmul
// (rq-tiled.h), which multiplies them against many activation columns, so the unpack is paid once per tile
void ggml_rq_itq3_codes_generic(const void * GGML_RESTRICT vx, uint8_t * GGML_RESTRICT dst) {
    const block_itq3_s * GGML_RESTRICT x = vx;
    for (int i = 0; i < QK_ITQ; ++i) {
        dst[i] = (uint8_t) (itq3_grid[itq3_code(x, i)] + 127);
    }
}

void ggml_vec_dot_itq3_s_q8_itq_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                        const void * GGML_RESTRICT vy, size_t by, int nrc) {
    assert(nrc == 1);
    assert(n % QK_ITQ == 0);
    GGML_UNUSED(nrc); GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);

    const block_itq3_s * GGML_RESTRICT x = vx;
    const block_q8_K   * GGML_RESTRICT y = vy;
    float sumf = 0.0f;
    for (int ib = 0; ib < n / QK_ITQ; ++ib) {
        int32_t isum = 0, qsum = 0;
        for (int i = 0; i < QK_ITQ; ++i) {
            isum += itq3_grid[itq3_code(&x[ib], i)] * y[ib].qs[i];
            qsum += y[ib].qs[i];
        }
        sumf += y[ib].d * (GGML_CPU_FP16_TO_FP32(x[ib].d) * (float) isum + GGML_CPU_FP16_TO_FP32(x[ib].m) * (float) qsum);
    }
    *s = sumf;
}
