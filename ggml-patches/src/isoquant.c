// ISOQUANT3_0/ISOQUANT4_0 (128-value blocks) and ISOQUANT3_64/ISOQUANT4_64 (64-value blocks, head size 64)
// reference quantisers/dequantisers, the IsoQuant rotation, counters and switches.
// Part of ggml-base. Compiled with -ffp-contract=off: the numpy reference in
// rotaryquant/quants/isoquant.py follows the same operation order and matches bit for bit.
//
//   quantise:   s = ||x|| (float64 tree sum), xh = x/s, y = R xh = SO4(WHT(S xh)), idx = Lloyd-Max(y),
//               d = s / ||c[idx]|| (so the dequantised vector keeps the norm; see docs/isoquant-design.md)
//   dequantise: x' = R^T (d * c[idx])
// S is a fixed random +-1 vector: without it the WHT maps a constant offset across channels onto a
// single coordinate, which the scalar codebook then quantises badly.
// Block width qk = 128 or 64: the 64-wide rotation is WHT-64 with the first 64 signs and the first 16 SO(4)
// (SO(3)) groups of the 128 tables; each width has its own Lloyd-Max codebooks (isoquant-tables.h).

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-quants.h"
#include "ggml-impl.h"
#include "ggml-rq.h"

#include "isoquant-tables.h"
#include "rq-atomic.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

int ggml_rq_version(void) {
    return GGML_RQ_VERSION;
}

// ---------------------------------------------------------------------------------------------
// counters and switches

static rq_atomic_u64 rq_counters[GGML_RQ_COUNTER_COUNT];

static const char * const rq_counter_names[GGML_RQ_COUNTER_COUNT] = {
    [GGML_RQ_ISO_DEQUANT_ROWS]   = "iso_dequant_rows",
    [GGML_RQ_ISO_FUSED_CALLS]    = "iso_fused_calls",
    [GGML_RQ_ISO_FALLBACK_CALLS] = "iso_fallback_calls",
    [GGML_RQ_ISO_QUANT_ROWS]     = "iso_quant_rows",
    [GGML_RQ_ISO_AVX512_CALLS]   = "iso_avx512_calls",
    [GGML_RQ_ISO_SPLIT_CALLS]    = "iso_split_calls",
};

uint64_t ggml_rq_counter_get(enum ggml_rq_counter c) {
    return (unsigned) c < GGML_RQ_COUNTER_COUNT ? rq_atomic_load_u64(&rq_counters[c]) : 0;
}

void ggml_rq_counter_add(enum ggml_rq_counter c, uint64_t n) {
    if ((unsigned) c < GGML_RQ_COUNTER_COUNT) {
        rq_atomic_add_u64(&rq_counters[c], n);
    }
}

void ggml_rq_counters_reset(void) {
    for (int i = 0; i < GGML_RQ_COUNTER_COUNT; ++i) {
        rq_atomic_store_u64(&rq_counters[i], 0);
    }
}

const char * ggml_rq_counter_name(enum ggml_rq_counter c) {
    return (unsigned) c < GGML_RQ_COUNTER_COUNT ? rq_counter_names[c] : NULL;
}

size_t ggml_rq_tensor_offset(const char * field) {
#define RQ_FIELD(f) { #f, offsetof(struct ggml_tensor, f) }
    static const struct { const char * name; size_t off; } fields[] = {
        RQ_FIELD(type), RQ_FIELD(buffer), RQ_FIELD(ne), RQ_FIELD(nb), RQ_FIELD(op), RQ_FIELD(op_params),
        RQ_FIELD(flags), RQ_FIELD(src), RQ_FIELD(view_src), RQ_FIELD(view_offs), RQ_FIELD(data), RQ_FIELD(name),
        RQ_FIELD(extra), RQ_FIELD(padding),
    };
#undef RQ_FIELD
    if (strcmp(field, "sizeof") == 0) {
        return sizeof(struct ggml_tensor);
    }
    for (size_t i = 0; i < sizeof(fields)/sizeof(fields[0]); ++i) {
        if (strcmp(field, fields[i].name) == 0) {
            return fields[i].off;
        }
    }
    return SIZE_MAX;
}

void ggml_rq_flash_attn_ext_set_exact(struct ggml_tensor * fa, struct ggml_tensor * k_x,
                                      struct ggml_tensor * v_x, struct ggml_tensor * rows,
                                      struct ggml_tensor * until, struct ggml_tensor * q_pos) {
    const struct ggml_tensor * k = fa->src[1];
    const struct ggml_tensor * v = fa->src[2];
    GGML_ASSERT(fa->op == GGML_OP_FLASH_ATTN_EXT && ggml_rq_type_is_iso(v->type));
    GGML_ASSERT(k_x->type == GGML_TYPE_F16 && v_x->type == GGML_TYPE_F16 && rows->type == GGML_TYPE_I32);
    GGML_ASSERT(ggml_is_contiguous(k_x) && ggml_is_contiguous(v_x) && ggml_is_contiguous(rows));
    GGML_ASSERT(k_x->ne[0] == k->ne[0]*k->ne[2] && v_x->ne[0] == v->ne[0]*v->ne[2] && k_x->ne[1] == v_x->ne[1]);
    GGML_ASSERT(rows->ne[0] == k->ne[1] && rows->ne[1] == k->ne[3]);
    GGML_ASSERT((until == NULL) == (q_pos == NULL));
    if (until) {
        GGML_ASSERT(until->type == GGML_TYPE_I32 && q_pos->type == GGML_TYPE_I32);
        GGML_ASSERT(ggml_are_same_shape(until, rows) && ggml_is_contiguous(until) && ggml_is_contiguous(q_pos));
        GGML_ASSERT(q_pos->ne[0] == fa->src[0]->ne[1] && q_pos->ne[1] == fa->src[0]->ne[3]);
    }
    fa->src[5] = k_x;
    fa->src[6] = v_x;
    fa->src[7] = rows;
    fa->src[8] = until;
    fa->src[9] = q_pos;
}

static rq_atomic_int rq_iso_variant  = GGML_RQ_ISO_V3;
static rq_atomic_int rq_iso_skip_inv = 0;
static rq_atomic_int rq_cpu_avx512   = 1;
static rq_atomic_int rq_cpu_split    = 1;

void ggml_rq_iso_set_variant(enum ggml_rq_iso_variant v) {
    GGML_ASSERT((unsigned) v <= GGML_RQ_ISO_NONE);
    rq_atomic_store_int(&rq_iso_variant, (int) v);
}

enum ggml_rq_iso_variant ggml_rq_iso_get_variant(void) {
    return (enum ggml_rq_iso_variant) rq_atomic_load_int(&rq_iso_variant);
}

void ggml_rq_iso_set_skip_inverse(bool skip) { rq_atomic_store_int(&rq_iso_skip_inv, skip ? 1 : 0); }

bool ggml_rq_iso_get_skip_inverse(void) {
    return rq_atomic_load_int(&rq_iso_skip_inv) != 0;
}

void ggml_rq_cpu_set_avx512(bool allow) { rq_atomic_store_int(&rq_cpu_avx512, allow ? 1 : 0); }

bool ggml_rq_cpu_get_avx512(void) {
    return rq_atomic_load_int(&rq_cpu_avx512) != 0;
}

void ggml_rq_cpu_set_split(bool allow) { rq_atomic_store_int(&rq_cpu_split, allow ? 1 : 0); }

bool ggml_rq_cpu_get_split(void) {
    return rq_atomic_load_int(&rq_cpu_split) != 0;
}

const float * ggml_rq_iso_codebook(void) {
    return iq3_codebook;
}

const float * ggml_rq_iso_codebook_bits(int bits) {
    return ggml_rq_iso_codebook_qk(bits, QK_ISO);
}

const float * ggml_rq_iso_codebook_qk(int bits, int qk) {
    GGML_ASSERT((bits == 3 || bits == 4) && (qk == QK_ISO || qk == QK_ISO64));
    if (qk == QK_ISO64) {
        return bits == 3 ? iq3_64_codebook : iq4_64_codebook;
    }
    return bits == 3 ? iq3_codebook : iq4_codebook;
}

static const float * iso_bounds(int bits, int qk) {
    if (qk == QK_ISO64) {
        return bits == 3 ? iq3_64_bounds : iq4_64_bounds;
    }
    return bits == 3 ? iq3_bounds : iq4_bounds;
}

// ---------------------------------------------------------------------------------------------
// the rotation R = SO4 o WHT (variant v3), exact operation order shared with numpy

static void iq3_fwht(float * v, int qk) {
    ggml_rq_wht(v, qk, qk == QK_ISO64 ? iq64_wht_scale : iq3_wht_scale);
}

// y = M u per group of 4 (M row-major), or y = M^T u with transpose; groups 0 .. qk/4-1
static void iq3_blocks(const float (*M)[16], const float * u, float * y, bool transpose, int qk) {
    for (int g = 0; g < qk/4; ++g) {
        const float * m = M[g];
        const float u0 = u[4*g+0], u1 = u[4*g+1], u2 = u[4*g+2], u3 = u[4*g+3];
        for (int r = 0; r < 4; ++r) {
            const float m0 = transpose ? m[0*4 + r] : m[r*4 + 0];
            const float m1 = transpose ? m[1*4 + r] : m[r*4 + 1];
            const float m2 = transpose ? m[2*4 + r] : m[r*4 + 2];
            const float m3 = transpose ? m[3*4 + r] : m[r*4 + 3];
            y[4*g + r] = ((m0*u0 + m1*u1) + m2*u2) + m3*u3;
        }
    }
}

void ggml_rq_iso_rotate_qk(const float * x, float * y, int qk) {
    GGML_ASSERT(qk == QK_ISO || qk == QK_ISO64);
    const enum ggml_rq_iso_variant v = ggml_rq_iso_get_variant();
    float t[QK_ISO];
    if (v == GGML_RQ_ISO_V3 || v == GGML_RQ_ISO_V1) {
        for (int i = 0; i < qk; ++i) {
            t[i] = x[i] * iq3_signs[i];
        }
        iq3_fwht(t, qk);
    } else {
        memcpy(t, x, qk*sizeof(float));
    }
    switch (v) {
        case GGML_RQ_ISO_V3:
        case GGML_RQ_ISO_V2:   iq3_blocks(iq3_so4, t, y, false, qk); break;
        case GGML_RQ_ISO_V1:   iq3_blocks(iq3_so3, t, y, false, qk); break;
        case GGML_RQ_ISO_NONE: memcpy(y, t, qk*sizeof(float)); break;
    }
}

void ggml_rq_iso_rotate_inv_qk(const float * y, float * x, int qk) {
    GGML_ASSERT(qk == QK_ISO || qk == QK_ISO64);
    const enum ggml_rq_iso_variant v = ggml_rq_iso_get_variant();
    float t[QK_ISO];
    switch (v) {
        case GGML_RQ_ISO_V3:
        case GGML_RQ_ISO_V2:   iq3_blocks(iq3_so4, y, t, true, qk); break;
        case GGML_RQ_ISO_V1:   iq3_blocks(iq3_so3, y, t, true, qk); break;
        case GGML_RQ_ISO_NONE: memcpy(t, y, qk*sizeof(float)); break;
    }
    if (v == GGML_RQ_ISO_V3 || v == GGML_RQ_ISO_V1) {
        iq3_fwht(t, qk);
        for (int i = 0; i < qk; ++i) {
            t[i] *= iq3_signs[i];
        }
    }
    memcpy(x, t, qk*sizeof(float));
}

void ggml_rq_iso_rotate(const float * x, float * y) {
    ggml_rq_iso_rotate_qk(x, y, QK_ISO);
}

void ggml_rq_iso_rotate_inv(const float * y, float * x) {
    ggml_rq_iso_rotate_inv_qk(y, x, QK_ISO);
}

// ---------------------------------------------------------------------------------------------
// ISOQUANT3_0 / ISOQUANT4_0 / ISOQUANT3_64 / ISOQUANT4_64: one implementation; `bits` = 3 or 4 selects the
// codebook and the packing, `qk` = 128 or 64 the block width

// sum of squares of qk values as a fixed float64 tree (the order the numpy and CUDA versions use)
static double iq3_tree_sumsq(const float * GGML_RESTRICT x, int qk) {
    double a[QK_ISO];
    for (int i = 0; i < qk; ++i) {
        a[i] = (double) x[i] * (double) x[i];
    }
    for (int s = qk/2; s > 0; s >>= 1) {
        for (int i = 0; i < s; ++i) {
            a[i] = a[i] + a[i + s];
        }
    }
    return a[0];
}

// the block of `bits`-bit indices: d (fp16) then qk*bits/8 bytes; all four block structs have this layout
static inline size_t iso_block_size(int bits, int qk) {
    return sizeof(ggml_half) + qk*bits/8;
}

// uncounted: iso_quantize_row/iso_dequantize_row count the blocks, ggml_rq_iso_roundtrip does not
static void iso_quantize_blocks(const float * GGML_RESTRICT x, uint8_t * GGML_RESTRICT y, int64_t k, int bits, int qk) {
    assert(k % qk == 0);
    const int64_t nb = k / qk;
    const float * cb   = ggml_rq_iso_codebook_qk(bits, qk);
    const float * bnd  = iso_bounds(bits, qk);
    const int     nbnd = (1 << bits) - 1;

    for (int64_t ib = 0; ib < nb; ++ib) {
        const float * xb  = x + ib*qk;
        uint8_t     * blk = y + ib*iso_block_size(bits, qk);
        uint8_t     * qs  = blk + sizeof(ggml_half);
        const double sd = sqrt(iq3_tree_sumsq(xb, qk));

        float xh[QK_ISO];
        float yr[QK_ISO];
        for (int i = 0; i < qk; ++i) {
            xh[i] = sd > 0.0 ? (float) ((double) xb[i] / sd) : 0.0f;
        }
        ggml_rq_iso_rotate_qk(xh, yr, qk);

        float c[QK_ISO];
        for (int g = 0; g < qk/8; ++g) {
            uint32_t w = 0;
            for (int j = 0; j < 8; ++j) {
                int idx = 0;  // #{k : y > bounds[k]} (strict; a NaN gives 0)
                for (int b = 0; b < nbnd; ++b) {
                    idx += yr[8*g + j] > bnd[b];
                }
                c[8*g + j] = cb[idx];
                w |= (uint32_t) idx << (bits*j);
            }
            for (int b = 0; b < bits; ++b) {
                qs[bits*g + b] = (uint8_t) ((w >> (8*b)) & 0xff);
            }
        }

        // norm-preserving scale: ||d c|| = ||x||; the codebooks have no zero level, so ||c|| > 0
        const double dd = sd / sqrt(iq3_tree_sumsq(c, qk));
        const ggml_half d = GGML_FP32_TO_FP16((float) (dd < 65504.0 ? dd : 65504.0));
        memcpy(blk, &d, sizeof(d));
    }
}

static void iso_dequantize_blocks(const uint8_t * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k, int bits, int qk) {
    assert(k % qk == 0);
    const int64_t  nb   = k / qk;
    const float  * cb   = ggml_rq_iso_codebook_qk(bits, qk);
    const uint32_t mask = (1u << bits) - 1;

    for (int64_t ib = 0; ib < nb; ++ib) {
        const uint8_t * blk = x + ib*iso_block_size(bits, qk);
        ggml_half dh;
        memcpy(&dh, blk, sizeof(dh));
        const float d = GGML_FP16_TO_FP32(dh);
        float yr[QK_ISO];
        for (int g = 0; g < qk/8; ++g) {
            const uint32_t w = ggml_rq_iso_word(blk + sizeof(ggml_half), g, bits);
            for (int j = 0; j < 8; ++j) {
                yr[8*g + j] = d * cb[(w >> (bits*j)) & mask];
            }
        }
        ggml_rq_iso_rotate_inv_qk(yr, y + ib*qk, qk);
    }
}

static void iso_quantize_row(const float * GGML_RESTRICT x, uint8_t * GGML_RESTRICT y, int64_t k, int bits, int qk) {
    iso_quantize_blocks(x, y, k, bits, qk);
    ggml_rq_counter_add(GGML_RQ_ISO_QUANT_ROWS, (uint64_t) (k / qk));
}

static void iso_dequantize_row(const uint8_t * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k, int bits, int qk) {
    iso_dequantize_blocks(x, y, k, bits, qk);
    ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) (k / qk));
}

void ggml_rq_iso_roundtrip(enum ggml_type type, const float * x, float * y, int64_t k) {
    const int bits = ggml_rq_iso_bits(type), qk = ggml_rq_iso_qk(type);
    uint8_t blk[sizeof(ggml_half) + QK_ISO*4/8];
    GGML_ASSERT(ggml_rq_type_is_iso(type) && k % qk == 0);
    for (int64_t i = 0; i < k; i += qk) {
        iso_quantize_blocks(x + i, blk, qk, bits, qk);
        iso_dequantize_blocks(blk, y + i, qk, bits, qk);
    }
}

// the public entry points of one type (ggml's traits and ggml_quantize_chunk call these)
#define ISO_TYPE_API(name, bits, qk)                                                                             \
void quantize_row_##name##_ref(const float * GGML_RESTRICT x, block_##name * GGML_RESTRICT y, int64_t k) {         \
    iso_quantize_row(x, (uint8_t *) y, k, bits, qk);                                                             \
}                                                                                                                \
void dequantize_row_##name(const block_##name * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {             \
    iso_dequantize_row((const uint8_t *) x, y, k, bits, qk);                                                     \
}                                                                                                                \
size_t quantize_##name(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrow, int64_t n_per_row, \
                       const float * imatrix) {                                                                  \
    GGML_UNUSED(imatrix); /* KV-cache type: no importance weighting */                                           \
    iso_quantize_row(src, (uint8_t *) dst, nrow*n_per_row, bits, qk);                                            \
    return nrow * iso_block_size(bits, qk) * (n_per_row / qk);                                                   \
}

ISO_TYPE_API(isoquant3_0,  3, QK_ISO)
ISO_TYPE_API(isoquant4_0,  4, QK_ISO)
ISO_TYPE_API(isoquant3_64, 3, QK_ISO64)
ISO_TYPE_API(isoquant4_64, 4, QK_ISO64)

// ---------------------------------------------------------------------------------------------
// ISOQ_Q / ISOQ_Q64: the rotated query (vec_dot_type of ISOQUANT3_0/4_0 / ISOQUANT3_64/4_64); not
// normalised, not quantised

void quantize_row_isoq_q_ref(const float * GGML_RESTRICT x, block_isoq_q * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ISO == 0);
    for (int64_t ib = 0; ib < k / QK_ISO; ++ib) {
        ggml_rq_iso_rotate(x + ib*QK_ISO, y[ib].qr);
    }
}

void quantize_row_isoq_q64_ref(const float * GGML_RESTRICT x, block_isoq_q64 * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ISO64 == 0);
    for (int64_t ib = 0; ib < k / QK_ISO64; ++ib) {
        ggml_rq_iso_rotate_qk(x + ib*QK_ISO64, y[ib].qr, QK_ISO64);
    }
}
