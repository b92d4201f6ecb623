// ITQ3_S reference quantiser/dequantiser and the Q8_ITQ activation format. Part of ggml-base,
// compiled with -ffp-contract=off: rotaryquant/quants/itq3.py follows the same operation order and matches
// bit for bit (docs/itq3-design.md has the spec and the measurements behind every choice).
//
//   quantise:   y = FWHT256(S w); centre; pick the step d among 4 candidates around the
//               Gaussian-optimal one (least-squares (d, o) per candidate), 3 Lloyd rounds;
//               codes q on the 8-level grid, w_rot ~ d*grid[q] + m
//   dequantise: w = S FWHT256(d*grid[q] + m)   (FWHT256 = H/16 is its own inverse)
//   matmul:     w.x = sum_b (H S w_b).(H S x_b): activations are rotated once per row (Q8_ITQ)
//   calibrated: LDLQ (error feedback in the rotated domain) against the inputs' Gram matrices
//               (ggml_rq_quantize_itq3_s_xtx) or diag(imatrix) (quantize_itq3_s with an imatrix)
//
// Codes: qs[j] holds the low 2 bits of codes j, 64+j, 128+j, 192+j (bits 0-1, 2-3, 4-5, 6-7);
// bit b of qh[j] is the high bit of code 32b+j. 32 consecutive codes then unpack with one shift
// and mask per bit plane.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-quants.h"
#include "ggml-impl.h"
#include "ggml-rq.h"
#include "ggml-threading.h"

#include "itq3-tables.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ITQ_VAR_EPS 0x1p-80f
#define ITQ_LLOYD   3
#define ITQ_W_CLAMP 1e15f

static const int itq3_thr2[7] = { -206, -124, -59, 0, 59, 124, 206 };

void ggml_rq_fwht256(float * GGML_RESTRICT v) {
    ggml_rq_wht(v, QK_ITQ, 0.0625f);
}

// pairwise sum over 256 values in a fixed order (a scratch copy is summed)
static float itq3_tree(const float * x) {
    float a[QK_ITQ/2];
    for (int i = 0; i < QK_ITQ/2; ++i) {
        a[i] = x[i] + x[i + QK_ITQ/2];
    }
    for (int n = QK_ITQ/4; n > 0; n >>= 1) {
        for (int i = 0; i < n; ++i) {
            a[i] = a[i] + a[i + n];
        }
    }
    return a[0];
}

static inline int itq3_code(float x2) {
    int q = 0;
    for (int k = 0; k < 7; ++k) {
        q += x2 >= (float) itq3_thr2[k];
    }
    return q;
}

static inline ggml_half itq3_f16_sat(float x) {
    return GGML_FP32_TO_FP16(x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x));
}

// codes for inverse half-step inv2 and offset o, and the sums of the least-squares fit of (d, o)
struct itq3_fit {
    float sgt; // sum grid[q_i] * yc_i
    float sg;  // sum grid[q_i] (exact)
    float den; // 256 sum grid^2 - (sum grid)^2
    float d, o;
};

static struct itq3_fit itq3_assign(const float * yc, float inv2, float o, uint8_t * q) {
    float p[QK_ITQ];
    int64_t sg = 0, sg2 = 0;
    for (int i = 0; i < QK_ITQ; ++i) {
        q[i] = (uint8_t) itq3_code((yc[i] - o) * inv2);
        const int g = itq3_grid[q[i]];
        p[i] = (float) g * yc[i];
        sg  += g;
        sg2 += g*g;
    }
    struct itq3_fit f;
    f.sgt = itq3_tree(p);
    f.sg  = (float) sg;
    f.den = (float) (256*sg2 - sg*sg);
    f.d   = f.den > 0 ? 256.0f*f.sgt/f.den : 0.0f;
    f.o   = -(f.d*f.sg)*(1.0f/256);
    return f;
}

static void itq3_pack(const uint8_t * q, block_itq3_s * out) {
    memset(out->qs, 0, sizeof(out->qs));
    for (int j = 0; j < QK_ITQ/4; ++j) {
        out->qs[j] = (uint8_t) ((q[j] & 3) | (q[64 + j] & 3) << 2 | (q[128 + j] & 3) << 4 | (q[192 + j] & 3) << 6);
    }
    for (int j = 0; j < QK_ITQ/8; ++j) {
        uint8_t h = 0;
        for (int b = 0; b < 8; ++b) {
            h |= (uint8_t) (((q[32*b + j] >> 2) & 1) << b);
        }
        out->qh[j] = h;
    }
}

static void itq3_quantize_block(const float * GGML_RESTRICT w_in, const float * GGML_RESTRICT iw, block_itq3_s * GGML_RESTRICT out) {
    float w[QK_ITQ], y[QK_ITQ], yc[QK_ITQ], t[QK_ITQ];
    uint8_t q[QK_ITQ];

    // |w| beyond ITQ_W_CLAMP is unrepresentable anyway (d and m saturate at 65504) and would overflow
    // the butterflies and sums of squares into Inf/NaN: clamp first (NaN stays NaN)
    for (int i = 0; i < QK_ITQ; ++i) {
        w[i] = w_in[i] > ITQ_W_CLAMP ? ITQ_W_CLAMP : (w_in[i] < -ITQ_W_CLAMP ? -ITQ_W_CLAMP : w_in[i]);
    }

    // 1. rotate
    ggml_rq_itq3_rotate(w, y);

    // 2. moments
    for (int i = 0; i < QK_ITQ; ++i) {
        t[i] = y[i]*y[i];
    }
    const float sy  = itq3_tree(y);
    const float ss  = itq3_tree(t);
    const float mu  = sy*(1.0f/256);
    const float var = ss*(1.0f/256) - mu*mu;
    const bool flat = !(var > ITQ_VAR_EPS);

    // 3. centre, Gaussian-optimal starting step
    for (int i = 0; i < QK_ITQ; ++i) {
        yc[i] = y[i] - mu;
    }
    const float d0 = itq3_C * sqrtf(flat ? 1.0f : var);

    // 4. scale candidates: keep the least-squares fit that removes the most error or, with an
    //    importance matrix, the one with the smallest weighted error in the original domain
    float d = 0.0f, o = -(0.0f*0.0f)*(1.0f/256);
    float best = iw ? INFINITY : -1.0f;
    for (int k = 0; k < 4; ++k) {
        const struct itq3_fit f = itq3_assign(yc, 2.0f/(d0*itq3_F[k]), 0.0f, q);
        float sc;
        if (!iw) {
            sc = f.den > 0 ? f.sgt*f.sgt/f.den : 0.0f;
            if (!(sc > best)) {
                continue;
            }
        } else {
            for (int i = 0; i < QK_ITQ; ++i) {
                t[i] = y[i] - ((f.d*(float) itq3_grid[q[i]] + f.o) + mu);
            }
            ggml_rq_fwht256(t);
            for (int i = 0; i < QK_ITQ; ++i) {
                const float e = t[i]*itq3_signs[i];
                t[i] = iw[i]*(e*e);
            }
            sc = itq3_tree(t);
            if (!(sc < best)) {
                continue;
            }
        }
        best = sc;
        d = f.d;
        o = f.o;
    }

    // 5. Lloyd rounds: reassign codes, refit (d, o)
    struct itq3_fit f = { 0 };
    for (int r = 0; r < ITQ_LLOYD; ++r) {
        f = itq3_assign(yc, 2.0f/(d > 0 ? d : d0), o, q);
        d = f.d;
        o = f.o;
    }

    // 6. final step and offset. The step is norm-preserving, not least-squares: the least-squares
    //    step shrinks every block by ~(1 - relMSE), a systematic gain bias in every matmul output;
    //    preserving the centred energy halves it for +0.4% RMSE. The offset absorbs fp16 rounding.
    float m;
    if (!iw) {
        for (int i = 0; i < QK_ITQ; ++i) {
            t[i] = yc[i]*yc[i];
        }
        const float syc2 = itq3_tree(t);
        d = (flat || !(d > 0)) ? 0.0f : sqrtf(256.0f*syc2/f.den);
        out->d = itq3_f16_sat(d);
        m = (sy - GGML_FP16_TO_FP32(out->d)*f.sg)*(1.0f/256);
    } else {
        if (flat || !(d > 0)) {
            d = 0.0f;
        }
        // weighted, norm-preserving refit in the original domain: u = S FWHT256(grid[q]); the rotated offset m
        // only moves original weight 0 (FWHT256 of a constant is 16 m e_0), so m makes w_0 exact
        float u[QK_ITQ], a[QK_ITQ], b[QK_ITQ];
        for (int i = 0; i < QK_ITQ; ++i) {
            u[i] = (float) itq3_grid[q[i]];
        }
        ggml_rq_fwht256(u);
        for (int i = 0; i < QK_ITQ; ++i) {
            u[i] *= itq3_signs[i];
            a[i] = (iw[i]*w[i])*u[i];
            b[i] = (iw[i]*u[i])*u[i];
            t[i] = (iw[i]*w[i])*w[i];
        }
        a[0] = 0.0f;
        b[0] = 0.0f;
        t[0] = 0.0f;
        const float num = itq3_tree(a);
        const float dn  = itq3_tree(b);
        const float ww  = itq3_tree(t);
        if (!flat && dn > 0 && num > 0) {
            d = sqrtf(ww/dn);
        }
        out->d = itq3_f16_sat(d);
        m = (w[0] - GGML_FP16_TO_FP32(out->d)*u[0])/(16.0f*itq3_signs[0]);
    }
    if (flat) {
        m = mu;
    }
    out->m = itq3_f16_sat(m);

    // 7. pack
    itq3_pack(q, out);
}

// ---------------------------------------------------------------------------------------------------
// LDLQ (GPTQ-style error feedback in the rotated domain, docs/itq3-design.md §5.3). float64 throughout,
// explicit loops in a fixed order; the numpy twin (rotaryquant/quants/itq3.py, quantize_rows_ldlq)
// performs the same operations in the same order, so the bytes match.
//
//   per 256-column block (shared by all rows):  A = R H R^T (R = FWHT256 diag(S)), A' = A/mean(diag A) + lambda I,
//       A' = V V^T with V upper (a backward Cholesky: no inverse needed; V = U^-1 for GPTQ's U = chol(A'^-1)),
//       L[k][j] = V_kj / V_jj (j > k), b = V^T 1
//   per row block: the plain quantiser's (d16, m16); codes in order k = 0..255 for the target
//       y_k + sum_{j<k} L[j][k] e_j  (e = y - (d g + m), the rotated residual so far); then the A'-weighted
//       least-squares (d, m) for those codes, through a = V^T g and c = V^T y (e^T A' e = |V^T e|^2)

#define ITQ_LDLQ_DAMP 0.1

struct itq3_ldlq {
    double * V;   // V[j*256 + k] = V_jk (j <= k), upper triangle of A' = V V^T
    double * L;   // L[k*256 + j] = V_kj / V_jj (j > k)
    double   b[QK_ITQ]; // V^T 1
    double   c11;       // |b|^2
};

static void itq3_fwht64(double * v) {
    for (int h = 1; h < QK_ITQ; h <<= 1) {
        for (int i = 0; i < QK_ITQ; i += 2*h) {
            for (int j = i; j < i + h; ++j) {
                const double a = v[j];
                const double b = v[j + h];
                v[j]     = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (int i = 0; i < QK_ITQ; ++i) {
        v[i] *= 0.0625;
    }
}

static double itq3_tree64(const double * x) {
    double a[QK_ITQ/2];
    for (int i = 0; i < QK_ITQ/2; ++i) {
        a[i] = x[i] + x[i + QK_ITQ/2];
    }
    for (int n = QK_ITQ/4; n > 0; n >>= 1) {
        for (int i = 0; i < n; ++i) {
            a[i] = a[i] + a[i + n];
        }
    }
    return a[0];
}

// A = R H R^T in float64 for H = (h + h^T)/2 (h 256x256 row-major) or H = diag(iw)
static void itq3_hess_rotate(const float * h, const float * iw, double * A) {
    for (int i = 0; i < QK_ITQ; ++i) {
        for (int j = 0; j < QK_ITQ; ++j) {
            double v;
            if (h) {
                v = (0.5*((double) h[i*QK_ITQ + j] + (double) h[j*QK_ITQ + i]))*(double) (itq3_signs[i]*itq3_signs[j]);
            } else {
                v = i == j ? (double) iw[i] : 0.0;
            }
            A[i*QK_ITQ + j] = v;
        }
    }
    for (int i = 0; i < QK_ITQ; ++i) {
        itq3_fwht64(A + i*QK_ITQ);     // rows
    }
    // columns: the same butterflies, applied to whole rows at a time (cache-friendly, same operations)
    for (int s = 1; s < QK_ITQ; s <<= 1) {
        for (int i = 0; i < QK_ITQ; i += 2*s) {
            for (int j = i; j < i + s; ++j) {
                double * u = A + j*QK_ITQ;
                double * v = A + (j + s)*QK_ITQ;
                for (int c = 0; c < QK_ITQ; ++c) {
                    const double a = u[c];
                    const double b = v[c];
                    u[c] = a + b;
                    v[c] = a - b;
                }
            }
        }
    }
    for (int i = 0; i < QK_ITQ*QK_ITQ; ++i) {
        A[i] *= 0.0625;
    }
}

// normalise, damp and factor A (consumed; becomes L); false if A is degenerate (the caller falls back)
static bool itq3_ldlq_factor(double * A, double damp, struct itq3_ldlq * f) {
    double dg[QK_ITQ], v[QK_ITQ];
    for (int i = 0; i < QK_ITQ*QK_ITQ; ++i) {
        if (!isfinite(A[i])) {
            return false;
        }
    }
    for (int i = 0; i < QK_ITQ; ++i) {
        dg[i] = A[i*QK_ITQ + i];
    }
    const double mu = itq3_tree64(dg)*(1.0/256);
    if (!(mu > 0) || !isfinite(mu)) {
        return false;
    }
    for (int i = 0; i < QK_ITQ*QK_ITQ; ++i) {
        A[i] = A[i]/mu;
    }
    for (int i = 0; i < QK_ITQ; ++i) {
        A[i*QK_ITQ + i] = A[i*QK_ITQ + i] + damp;
    }
    double * V = f->V;
    memset(V, 0, QK_ITQ*QK_ITQ*sizeof(double));
    // backward Cholesky on the upper triangle: k = 255..0
    for (int k = QK_ITQ - 1; k >= 0; --k) {
        const double p = A[k*QK_ITQ + k];
        if (!(p > 0) || !isfinite(p)) {
            return false;
        }
        const double vkk = sqrt(p);
        V[k*QK_ITQ + k] = vkk;
        for (int i = 0; i < k; ++i) {
            v[i] = A[i*QK_ITQ + k]/vkk;
            V[i*QK_ITQ + k] = v[i];
        }
        for (int i = 0; i < k; ++i) {
            double * Ai = A + i*QK_ITQ;
            const double vi = v[i];
            for (int j = i; j < k; ++j) {
                Ai[j] = Ai[j] - vi*v[j];
            }
        }
    }
    double * L = A;
    memset(L, 0, QK_ITQ*QK_ITQ*sizeof(double));
    for (int k = 0; k < QK_ITQ; ++k) {
        for (int j = k + 1; j < QK_ITQ; ++j) {
            L[k*QK_ITQ + j] = V[k*QK_ITQ + j]/V[j*QK_ITQ + j];
        }
    }
    f->L = L;
    for (int k = 0; k < QK_ITQ; ++k) {
        f->b[k] = 0.0;
    }
    for (int j = 0; j < QK_ITQ; ++j) {
        for (int k = j; k < QK_ITQ; ++k) {
            f->b[k] = f->b[k] + V[j*QK_ITQ + k]*1.0;
        }
    }
    double s = 0.0;
    for (int k = 0; k < QK_ITQ; ++k) {
        s = s + f->b[k]*f->b[k];
    }
    f->c11 = s;
    return true;
}

static inline int itq3_code64(double x2) {
    int q = 0;
    for (int k = 0; k < 7; ++k) {
        q += x2 >= (double) itq3_thr2[k];
    }
    return q;
}

// one block: the plain quantiser, then (when its step is usable) LDLQ codes and the A'-weighted refit
static void itq3_ldlq_block(const float * GGML_RESTRICT w_in, const struct itq3_ldlq * f, block_itq3_s * GGML_RESTRICT out) {
    itq3_quantize_block(w_in, NULL, out);
    const float d = GGML_FP16_TO_FP32(out->d);
    const float m = GGML_FP16_TO_FP32(out->m);
    if (!(d > 0) || !isfinite(d) || !isfinite(m)) {
        return; // flat block (or NaN/inf input): nothing to feed back
    }
    float w[QK_ITQ], y[QK_ITQ];
    for (int i = 0; i < QK_ITQ; ++i) {
        w[i] = w_in[i] > ITQ_W_CLAMP ? ITQ_W_CLAMP : (w_in[i] < -ITQ_W_CLAMP ? -ITQ_W_CLAMP : w_in[i]);
    }
    ggml_rq_itq3_rotate(w, y);
    for (int i = 0; i < QK_ITQ; ++i) {
        if (!isfinite(y[i])) {
            return;
        }
    }
    double t[QK_ITQ], a[QK_ITQ], c[QK_ITQ];
    uint8_t q[QK_ITQ];
    const double dd = d, mm = m, inv2 = 2.0/dd;
    for (int i = 0; i < QK_ITQ; ++i) {
        t[i] = (double) y[i];
    }
    // sequential rounding with error feedback
    for (int k = 0; k < QK_ITQ; ++k) {
        q[k] = (uint8_t) itq3_code64((t[k] - mm)*inv2);
        const double e = (double) y[k] - (dd*(double) itq3_grid[q[k]] + mm);
        const double * Lk = f->L + k*QK_ITQ;
        for (int j = k + 1; j < QK_ITQ; ++j) {
            t[j] = t[j] + Lk[j]*e;
        }
    }
    // refit: minimise |V^T (y - d g - m 1)|^2 = (y - d g - m)^T A' (y - d g - m)
    for (int k = 0; k < QK_ITQ; ++k) {
        a[k] = 0.0;
        c[k] = 0.0;
    }
    for (int j = 0; j < QK_ITQ; ++j) {
        const double * Vj = f->V + j*QK_ITQ;
        const double gj = (double) itq3_grid[q[j]];
        const double yj = (double) y[j];
        for (int k = j; k < QK_ITQ; ++k) {
            a[k] = a[k] + Vj[k]*gj;
            c[k] = c[k] + Vj[k]*yj;
        }
    }
    double c00 = 0.0, c01 = 0.0, r0 = 0.0, r1 = 0.0;
    for (int k = 0; k < QK_ITQ; ++k) {
        c00 = c00 + a[k]*a[k];
        c01 = c01 + a[k]*f->b[k];
        r0  = r0  + a[k]*c[k];
        r1  = r1  + f->b[k]*c[k];
    }
    const double c11 = f->c11;
    const double det = c00*c11 - c01*c01;
    if (det > 1e-9*(c00*c11) && isfinite(det)) {
        const double dn = (r0*c11 - r1*c01)/det;
        if (dn > 0 && isfinite(dn)) {
            const ggml_half d16 = itq3_f16_sat((float) dn);
            const double d2 = (double) GGML_FP16_TO_FP32(d16);
            const double mn = (r1 - d2*c01)/c11;
            if (d2 > 0 && isfinite(mn)) {
                out->d = d16;
                out->m = itq3_f16_sat((float) mn);
            }
        }
    }
    itq3_pack(q, out);
}

// a factor and the memory it lives in (1 MiB: A, then L, and V)
struct itq3_fac {
    struct itq3_ldlq f;
    double * mem;
    bool     ok;   // false: the Hessian is degenerate, the rows get the quantiser without LDLQ
};

static bool itq3_fac_new(const float * h, const float * iw, struct itq3_fac * F) {
    F->mem = (double *) malloc(2*QK_ITQ*QK_ITQ*sizeof(double));
    F->ok  = false;
    if (!F->mem) {
        return false;
    }
    F->f.L   = F->mem;
    F->f.V   = F->mem + QK_ITQ*QK_ITQ;
    F->f.c11 = 0.0;
    itq3_hess_rotate(h, iw, F->mem);
    F->ok = itq3_ldlq_factor(F->mem, ITQ_LDLQ_DAMP, &F->f);
    return true;
}

// imatrix factors, cached: llama-quantize calls quantize_itq3_s once per chunk of ~16K weights (one or a few rows),
// and a factor (~2 ms) per column block per chunk would cost more than the quantisation itself. A factor is a pure
// function of the 256 importances, so a cache keyed by their bits is exact; entries in use are never evicted.
#define ITQ_CACHE_N 128  // column blocks of one tensor (n_per_row up to 32768) stay resident; at most 128 MiB

struct itq3_cent {
    float           iw[QK_ITQ];
    struct itq3_fac F;
    int             refs;
    uint64_t        used;
    bool            valid;
};

static struct itq3_cent itq3_cache[ITQ_CACHE_N];
static uint64_t         itq3_cache_clock;

// the cached factor of iw (NULL: none was cached, *priv holds a private one the caller frees; priv->mem is NULL
// if memory ran out)
static struct itq3_cent * itq3_cache_get(const float * iw, struct itq3_fac * priv) {
    ggml_critical_section_start();
    for (int i = 0; i < ITQ_CACHE_N; ++i) {
        struct itq3_cent * e = &itq3_cache[i];
        if (e->valid && memcmp(e->iw, iw, sizeof(e->iw)) == 0) {
            e->refs++;
            e->used = ++itq3_cache_clock;
            ggml_critical_section_end();
            return e;
        }
    }
    ggml_critical_section_end();

    struct itq3_fac F;
    if (!itq3_fac_new(NULL, iw, &F)) {
        priv->mem = NULL;
        return NULL;
    }

    ggml_critical_section_start();
    struct itq3_cent * v = NULL;
    for (int i = 0; i < ITQ_CACHE_N; ++i) {
        struct itq3_cent * e = &itq3_cache[i];
        if (e->valid && memcmp(e->iw, iw, sizeof(e->iw)) == 0) {
            // another thread built the same factor meanwhile: identical by construction, use that one
            e->refs++;
            e->used = ++itq3_cache_clock;
            ggml_critical_section_end();
            free(F.mem);
            return e;
        }
        if (e->refs == 0 && (!v || (!e->valid && v->valid) || (e->valid && v->valid && e->used < v->used))) {
            v = e;
        }
    }
    if (!v) {
        ggml_critical_section_end();
        *priv = F;
        return NULL;
    }
    if (v->valid) {
        free(v->F.mem);
    }
    memcpy(v->iw, iw, sizeof(v->iw));
    v->F     = F;
    v->valid = true;
    v->refs  = 1;
    v->used  = ++itq3_cache_clock;
    ggml_critical_section_end();
    return v;
}

static void itq3_cache_put(struct itq3_cent * e) {
    ggml_critical_section_start();
    e->refs--;
    ggml_critical_section_end();
}

// LDLQ over rows, column block by column block, one factor each: H from xtx's Gram blocks (degenerate: the plain
// quantiser) or H = diag(imatrix) (degenerate: the v1 imatrix quantiser of the block). Rows never influence each
// other or the factor, so any split into row chunks gives the same bytes.
static size_t itq3_quantize_ldlq(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrow, int64_t n_per_row,
                                 const float * xtx, const float * imatrix) {
    assert(n_per_row % QK_ITQ == 0);
    const size_t row_size = ggml_row_size(GGML_TYPE_ITQ3_S, n_per_row);
    const int64_t nb = n_per_row / QK_ITQ;
    for (int64_t ib = 0; ib < nb; ++ib) {
        const float * iw = imatrix ? imatrix + ib*QK_ITQ : NULL;
        struct itq3_fac priv = { 0 };
        struct itq3_cent * e = NULL;
        if (iw) {
            e = itq3_cache_get(iw, &priv);
        } else {
            itq3_fac_new(xtx + ib*QK_ITQ*QK_ITQ, NULL, &priv);
        }
        const struct itq3_fac * F = e ? &e->F : &priv;
        if (!F->mem) {
            GGML_LOG_WARN("%s: out of memory for the LDLQ factor, quantising without it\n", __func__);
        }
        const bool ok = F->mem && F->ok;
        for (int64_t r = 0; r < nrow; ++r) {
            block_itq3_s * yb = (block_itq3_s *) ((char *) dst + r*row_size) + ib;
            const float * x = src + r*n_per_row + ib*QK_ITQ;
            if (ok) {
                itq3_ldlq_block(x, &F->f, yb);
            } else {
                itq3_quantize_block(x, iw, yb);
            }
        }
        if (e) {
            itq3_cache_put(e);
        }
        free(priv.mem);
    }
    return nrow * row_size;
}

size_t ggml_rq_quantize_itq3_s_xtx(const float * src, void * dst, int64_t nrow, int64_t n_per_row, const float * xtx) {
    if (!xtx) {
        return quantize_itq3_s(src, dst, nrow, n_per_row, NULL);
    }
    return itq3_quantize_ldlq(src, dst, nrow, n_per_row, xtx, NULL);
}

void quantize_row_itq3_s_ref(const float * GGML_RESTRICT x, block_itq3_s * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ITQ == 0);
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        itq3_quantize_block(x + ib*QK_ITQ, NULL, y + ib);
    }
}

// with an imatrix: LDLQ with H = diag(imatrix) (docs/itq3-design.md §5.3; measured better than the v1 candidate
// ranking on every tensor, §6.6)
size_t quantize_itq3_s(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrow, int64_t n_per_row, const float * imatrix) {
    assert(n_per_row % QK_ITQ == 0);
    if (imatrix) {
        return itq3_quantize_ldlq(src, dst, nrow, n_per_row, NULL, imatrix);
    }
    const size_t row_size = ggml_row_size(GGML_TYPE_ITQ3_S, n_per_row);
    char * qrow = (char *) dst;
    for (int64_t r = 0; r < nrow; ++r) {
        block_itq3_s * yb = (block_itq3_s *) qrow;
        for (int64_t ib = 0; ib < n_per_row / QK_ITQ; ++ib) {
            itq3_quantize_block(src + r*n_per_row + ib*QK_ITQ, NULL, yb + ib);
        }
        qrow += row_size;
    }
    return nrow * row_size;
}

void dequantize_row_itq3_s(const block_itq3_s * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ITQ == 0);
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        const float d = GGML_FP16_TO_FP32(x[ib].d);
        const float m = GGML_FP16_TO_FP32(x[ib].m);
        float * v = y + ib*QK_ITQ;
        for (int i = 0; i < QK_ITQ; ++i) {
            const int q = ((x[ib].qs[i & 63] >> (2*(i >> 6))) & 3) | (((x[ib].qh[i & 31] >> (i >> 5)) & 1) << 2);
            v[i] = d*(float) itq3_grid[q] + m;
        }
        ggml_rq_fwht256(v);
        for (int i = 0; i < QK_ITQ; ++i) {
            v[i] *= itq3_signs[i];
        }
    }
}

void ggml_rq_itq3_rotate(const float * GGML_RESTRICT x, float * GGML_RESTRICT t) {
    for (int i = 0; i < QK_ITQ; ++i) {
        t[i] = x[i]*itq3_signs[i];
    }
    ggml_rq_fwht256(t);
}

// Q8_ITQ: rotate each 256-block of an activation row like the weights, then Q8_K
// Q8_K's rounding (the block's signed extreme maps to -QMAX exactly) with 7-bit codes, |q| <= 63: ggml-cpu's
// tiled matmul multiplies them with unsigned codes up to 254 (grid + 127) in maddubs pairs, 2*254*63 < 32767.
// The extra rounding is ~1% of an output against ITQ3_S's ~18% weight error (docs/itq3-design.md).
void ggml_rq_quantize_q7_K(const float * GGML_RESTRICT t, block_q8_K * GGML_RESTRICT y) {
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < QK_ITQ; ++j) {
        if (fabsf(t[j]) > amax) {
            amax = fabsf(t[j]);
            max  = t[j];
        }
    }
    if (!amax) {
        memset(y, 0, sizeof(*y));
        return;
    }
    const float iscale = -(float) RQ_Q7_MAX/max;
    for (int j = 0; j < QK_ITQ; ++j) {
        const int v = (int) lrintf(iscale*t[j]);
        y->qs[j] = (int8_t) (v < -RQ_Q7_MAX ? -RQ_Q7_MAX : v > RQ_Q7_MAX ? RQ_Q7_MAX : v);
    }
    for (int j = 0; j < QK_ITQ/16; ++j) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) {
            sum += y->qs[16*j + i];
        }
        y->bsums[j] = (int16_t) sum;
    }
    y->d = 1/iscale;
}

void quantize_row_q8_itq_ref(const float * GGML_RESTRICT x, block_q8_K * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_ITQ == 0);
    float t[QK_ITQ];
    for (int64_t ib = 0; ib < k / QK_ITQ; ++ib) {
        ggml_rq_itq3_rotate(x + ib*QK_ITQ, t);
        ggml_rq_quantize_q7_K(t, y + ib);
    }
}
