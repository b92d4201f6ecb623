// Fused IsoQuant flash attention against its slow twin.
//
// The fused CPU path scores packed IsoQuant (ISOQUANT3_0, ISOQUANT4_0, and the 64-value-block ISOQUANT3_64,
// ISOQUANT4_64) keys against a rotated query and accumulates V in the
// rotated domain, rotating back once per row. The twin dequantises K/V with the type's to_float
// (bit-exact with the numpy reference) and runs ordinary F32 flash attention. Both see the same
// packed data, so they must agree to float rounding. Counters must show the fused path ran and the
// fused run dequantised nothing.

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-rq.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static int n_fail = 0;

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); ++n_fail; } } while (0)

static void fill(std::vector<float> & x, std::mt19937 & rng, float scale, float outlier) {
    std::normal_distribution<float> nd(0.0f, scale);
    for (auto & v : x) v = nd(rng);
    // a few large fixed channels, as real keys have
    for (size_t i = 3; i < x.size(); i += 61) x[i] *= outlier;
}

// one flash-attention evaluation; K/V of type tk/tv built from the float data (quantised if needed).
// cast_f16: the unfused path as llama builds it - K/V stored [hs, n_head_kv, n_kv] like the cache, viewed
// as [hs, n_kv, n_head_kv] by a permute, and cast to F16 before attention.
static std::vector<float> attend(ggml_type tk, ggml_type tv, const std::vector<float> & q, const std::vector<float> & k,
                                 const std::vector<float> & v, int hs, int n_q, int n_head, int n_kv, int n_head_kv,
                                 bool cast_f16 = false) {
    ggml_init_params ip = { 256u*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * tq = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hs, n_q, n_head);
    memcpy(tq->data, q.data(), ggml_nbytes(tq));

    auto make = [&](ggml_type t, const std::vector<float> & src) {
        ggml_tensor * x = cast_f16 ? ggml_new_tensor_3d(ctx, t, hs, n_head_kv, n_kv) : ggml_new_tensor_3d(ctx, t, hs, n_kv, n_head_kv);
        if (t == GGML_TYPE_F32) {
            memcpy(x->data, src.data(), ggml_nbytes(x));
        } else if (t == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(src.data(), (ggml_fp16_t *) x->data, (int64_t) src.size());
        } else {
            ggml_quantize_chunk(t, src.data(), x->data, 0, (int64_t) n_kv*n_head_kv, hs, nullptr);
        }
        return x;
    };
    ggml_tensor * tk_ = make(tk, k);
    ggml_tensor * tv_ = make(tv, v);
    if (cast_f16) {
        tk_ = ggml_cast(ctx, ggml_permute(ctx, tk_, 0, 2, 1, 3), GGML_TYPE_F16);
        tv_ = ggml_cast(ctx, ggml_permute(ctx, tv_, 0, 2, 1, 3), GGML_TYPE_F16);
    }

    ggml_tensor * out = ggml_flash_attn_ext(ctx, tq, tk_, tv_, nullptr, 1.0f/sqrtf((float) hs), 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, 2);

    std::vector<float> res(ggml_nelements(out));
    memcpy(res.data(), out->data, ggml_nbytes(out));
    ggml_free(ctx);
    return res;
}

// the float twin of an IsoQuant tensor: quantise, then dequantise with to_float (the reference code)
static std::vector<float> roundtrip(const std::vector<float> & x, int hs, ggml_type t) {
    std::vector<uint8_t> packed(ggml_row_size(t, hs) * (x.size() / hs));
    ggml_quantize_chunk(t, x.data(), packed.data(), 0, (int64_t) x.size() / hs, hs, nullptr);
    std::vector<float> y(x.size());
    ggml_get_type_traits(t)->to_float(packed.data(), y.data(), (int64_t) x.size());
    return y;
}

// Exact rows (ggml_rq_flash_attn_ext_set_exact): cells listed in rows take K/V from F16 rows in place of their packed
// ones. q [hs, n_q, n_head, n_stream], k/v [hs, n_kv, n_head_kv, n_stream] (floats quantised to tk/tv), xk/xv the
// exact rows [hs*n_head_kv, n_rows] as floats (stored F16), rows [n_kv, n_stream], mask [n_kv, n_q] shared by the
// streams (NaN: no mask). Without xk (empty) it is plain flash attention.
static std::vector<float> attend_x(ggml_type tk, ggml_type tv, const std::vector<float> & q, const std::vector<float> & k,
                                   const std::vector<float> & v, const std::vector<float> & xk, const std::vector<float> & xv,
                                   const std::vector<int32_t> & rows, const std::vector<float> & mask,
                                   int hs, int n_q, int n_head, int n_kv, int n_head_kv, int n_stream,
                                   const std::vector<int32_t> & until = {}, const std::vector<int32_t> & q_pos = {},
                                   int n_threads = 2) {
    ggml_init_params ip = { 256u*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * tq = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, hs, n_q, n_head, n_stream);
    memcpy(tq->data, q.data(), ggml_nbytes(tq));
    auto make = [&](ggml_type t, const std::vector<float> & src) {
        ggml_tensor * x = ggml_new_tensor_4d(ctx, t, hs, n_kv, n_head_kv, n_stream);
        if (t == GGML_TYPE_F32) {
            memcpy(x->data, src.data(), ggml_nbytes(x));
        } else {
            ggml_quantize_chunk(t, src.data(), x->data, 0, (int64_t) n_kv*n_head_kv*n_stream, hs, nullptr);
        }
        return x;
    };
    ggml_tensor * tm = nullptr;
    if (!mask.empty()) {
        tm = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);
        ggml_fp32_to_fp16_row(mask.data(), (ggml_fp16_t *) tm->data, (int64_t) mask.size());
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, tq, make(tk, k), make(tv, v), tm, 1.0f/sqrtf((float) hs), 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    if (!xk.empty()) {
        const int64_t n_rows = (int64_t) xk.size()/(hs*n_head_kv);
        ggml_tensor * kx = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, hs*n_head_kv, n_rows);
        ggml_tensor * vx = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, hs*n_head_kv, n_rows);
        ggml_tensor * tr = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, n_stream);
        ggml_fp32_to_fp16_row(xk.data(), (ggml_fp16_t *) kx->data, (int64_t) xk.size());
        ggml_fp32_to_fp16_row(xv.data(), (ggml_fp16_t *) vx->data, (int64_t) xv.size());
        memcpy(tr->data, rows.data(), ggml_nbytes(tr));
        ggml_tensor * tu = nullptr, * tp = nullptr;
        if (!until.empty()) {
            tu = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, n_stream);
            tp = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_q, n_stream);
            memcpy(tu->data, until.data(), ggml_nbytes(tu));
            memcpy(tp->data, q_pos.data(), ggml_nbytes(tp));
        }
        ggml_rq_flash_attn_ext_set_exact(out, kx, vx, tr, tu, tp);
    }
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    std::vector<float> res(ggml_nelements(out));
    memcpy(res.data(), out->data, ggml_nbytes(out));
    ggml_free(ctx);
    return res;
}

static float f16_round(float x) {
    return ggml_fp16_to_fp32(ggml_fp32_to_fp16(x));
}

static double rel_err(const std::vector<float> & a, const std::vector<float> & b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double) (a[i] - b[i]) * (a[i] - b[i]);
        den += (double) b[i] * b[i];
    }
    return sqrt(num / (den + 1e-30));
}

// the float kernels against their float twins; the VNNI scoring (AVX-512 CPUs) has its own twin further down
static void test_float_kernels(std::mt19937 & rng, int n_head, int n_head_kv) {
    ggml_rq_cpu_set_avx512(false);

    double sum_e4 = 0.0, sum_e3 = 0.0; // attention errors vs F32 of both index widths on the same data
    for (ggml_type it : {GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_0, GGML_TYPE_ISOQUANT3_64, GGML_TYPE_ISOQUANT4_64})
    for (int hs : {64, 128, 256}) {
        const int qk = ggml_rq_iso_qk(it);
        if (hs % qk != 0) {
            continue;
        }
        // the 3- and 4-bit types of this block width
        const ggml_type I3 = ggml_rq_iso_type(3, qk), I4 = ggml_rq_iso_type(4, qk);
        for (int n_kv : {1, 7, 300}) {
            for (int n_q : {1, 3}) {
                std::vector<float> q((size_t) hs*n_q*n_head), k((size_t) hs*n_kv*n_head_kv), v(k.size());
                fill(q, rng, 1.0f, 1.0f);
                fill(k, rng, 1.0f, 8.0f);
                fill(v, rng, 0.5f, 1.0f);

                const char * tn = ggml_type_name(it);
                const std::vector<float> kd = roundtrip(k, hs, it);
                const std::vector<float> vd = roundtrip(v, hs, it);
                // the other width, for the mixed cases (K one width, V the other)
                const ggml_type ot = it == I3 ? I4 : I3;
                const std::vector<float> vo = roundtrip(v, hs, ot);

                struct { ggml_type tk, tv; const std::vector<float> & kr, & vr; const char * name; } cases[] = {
                    { it,            it,            kd, vd, "iso/iso" },
                    { it,            GGML_TYPE_F32, kd, v,  "iso/f32" },
                    { GGML_TYPE_F32, it,            k,  vd, "f32/iso" },
                    { it,            ot,            kd, vo, "iso/other-iso" },
                };
                for (auto & c : cases) {
                    ggml_rq_counters_reset();
                    const std::vector<float> fused = attend(c.tk, c.tv, q, k, v, hs, n_q, n_head, n_kv, n_head_kv);
                    const uint64_t deq = ggml_rq_counter_get(GGML_RQ_ISO_DEQUANT_ROWS);
                    const uint64_t fcalls = ggml_rq_counter_get(GGML_RQ_ISO_FUSED_CALLS);
                    const std::vector<float> ref = attend(GGML_TYPE_F32, GGML_TYPE_F32, q, c.kr, c.vr, hs, n_q, n_head, n_kv, n_head_kv);
                    const double e = rel_err(fused, ref);
                    // both sides see identical packed values: only float summation order differs
                    CHECK(e < 2e-5, "%s hs=%d n_kv=%d n_q=%d %s: fused vs dequantised-F32 rel err %.3g", tn, hs, n_kv, n_q, c.name, e);
                    CHECK(deq == 0, "%s: fused attention dequantised %llu rows", c.name, (unsigned long long) deq);
                    CHECK(fcalls == 1, "%s: fused calls %llu != 1", c.name, (unsigned long long) fcalls);
                }

                // the unfused twin: permuted views cast to F16 (dequantising every row), then F16 attention.
                // Same packed values; F16 rounding of K/V and the F16 accumulation of V (upstream F16-V path,
                // error grows with n_kv: 2e-4 at 7 keys, 3e-3 at 300) are the only differences.
                {
                    // the float data in cache order [hs, n_head_kv, n_kv]
                    auto to_cache_order = [&](const std::vector<float> & x) {
                        std::vector<float> y(x.size());
                        for (int h = 0; h < n_head_kv; ++h)
                            for (int j = 0; j < n_kv; ++j)
                                memcpy(&y[((size_t) j*n_head_kv + h)*hs], &x[((size_t) h*n_kv + j)*hs], hs*sizeof(float));
                        return y;
                    };
                    ggml_rq_counters_reset();
                    const std::vector<float> unf = attend(it, it, q, to_cache_order(k),
                                                          to_cache_order(v), hs, n_q, n_head, n_kv, n_head_kv, true);
                    const uint64_t deq = ggml_rq_counter_get(GGML_RQ_ISO_DEQUANT_ROWS);
                    const std::vector<float> ref = attend(GGML_TYPE_F32, GGML_TYPE_F32, q, kd, vd, hs, n_q, n_head, n_kv, n_head_kv);
                    const double e = rel_err(unf, ref);
                    CHECK(e < 5e-3, "%s hs=%d n_kv=%d n_q=%d unfused (F16 cast) vs dequantised-F32 rel err %.3g", tn, hs, n_kv, n_q, e);
                    CHECK(deq == (uint64_t) 2*n_kv*n_head_kv*(hs/qk), "unfused dequantised %llu rows", (unsigned long long) deq);
                }

                // the type itself against unquantised attention: a garbage detector, not a quality claim
                // (3-bit noise on random V is ~18% per vector, 4-bit ~10%; softmax averages do not shrink it
                // relative to the averaged signal; wrong rotations, scales or codebooks land near or above 1)
                const std::vector<float> exact = attend(GGML_TYPE_F32, GGML_TYPE_F32, q, k, v, hs, n_q, n_head, n_kv, n_head_kv);
                const std::vector<float> iso   = attend(it, it, q, k, v, hs, n_q, n_head, n_kv, n_head_kv);
                const double eq = rel_err(iso, exact);
                CHECK(eq < (it == I3 ? 0.5 : 0.4), "%s hs=%d n_kv=%d n_q=%d: attention rel err %.3g vs F32", tn, hs, n_kv, n_q, eq);
                if (it == I4) {
                    // and 4 bits must beat 3 bits on the same data (measured: 0.45-0.6x, once 0.9x)
                    const double e3 = rel_err(attend(I3, I3, q, k, v, hs, n_q, n_head, n_kv, n_head_kv), exact);
                    CHECK(eq < e3, "hs=%d n_kv=%d n_q=%d: 4-bit attention (%.3g) not better than 3-bit (%.3g)", hs, n_kv, n_q, eq, e3);
                    sum_e4 += eq;
                    sum_e3 += e3;
                }
            }
        }
    }

    // the 4-bit codebook's noise is half the 3-bit one's (sqrt of the MSE ratio 0.0093/0.034 = 0.52)
    CHECK(sum_e4 < 0.7*sum_e3, "4-bit attention error %.3g is not well below 3-bit %.3g (summed over cases)", sum_e4, sum_e3);
}

// sharp attention: most keys score far below the row's max, where the kernel flushes their weights to 0 rather
// than take denormals (RQ_FA_FTZ, 80 below the max). The flushed keys weigh < 2^-115 each, so the fused output
// still matches F32 attention over the same values (which keeps them) as closely as at ordinary scores (a
// threshold at -10 fails: 2.7e-5 for 4 bits, and 30 checks above). 2000 keys: two chunks and their fold.
// The float kernels only: the AVX-512 ones share the softmax, but their int8 query moves such scores by up to a
// nat, so they are not within 2e-5 of F32 here (measured: 0.005 / 0.096 rel err for 3 / 4 bits, 0.010 / 0.013 at
// ordinary scores; their twin below checks their rounding).
static void test_sharp(std::mt19937 & rng, int n_head, int n_head_kv) {
    for (ggml_type it : {GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_0}) {
        const int hs = 128, n_kv = 2000, n_q = 1;
        std::vector<float> q((size_t) hs*n_q*n_head), k((size_t) hs*n_kv*n_head_kv), v(k.size());
        fill(q, rng, 1.0f, 1.0f);
        fill(k, rng, 1.0f, 8.0f);
        fill(v, rng, 0.5f, 1.0f);
        const std::vector<float> kd = roundtrip(k, hs, it), vd = roundtrip(v, hs, it);
        // scale q until over half the keys of every row score more than 100 below its max (scores over the
        // dequantised keys, as the kernel sees them)
        float qs = 1.0f;
        for (;; qs *= 1.25f) {
            int min_far = n_kv;
            for (int h = 0; h < n_head; ++h) {
                const int hk = h/(n_head/n_head_kv);
                std::vector<double> s(n_kv);
                for (int j = 0; j < n_kv; ++j) {
                    double d = 0.0;
                    for (int i = 0; i < hs; ++i) d += (double) qs*q[(size_t) h*hs + i]*kd[((size_t) hk*n_kv + j)*hs + i];
                    s[j] = d/sqrt((double) hs);
                }
                const double mx = *std::max_element(s.begin(), s.end());
                min_far = std::min(min_far, (int) std::count_if(s.begin(), s.end(), [&](double x) { return x < mx - 100.0; }));
            }
            if (min_far > n_kv/2) break;
        }
        std::vector<float> qq(q);
        for (auto & x : qq) x *= qs;
        const std::vector<float> fused = attend(it, it, qq, k, v, hs, n_q, n_head, n_kv, n_head_kv);
        const std::vector<float> ref = attend(GGML_TYPE_F32, GGML_TYPE_F32, qq, kd, vd, hs, n_q, n_head, n_kv, n_head_kv);
        const double e = rel_err(fused, ref);
        // summation order only, as above
        CHECK(e < 2e-5, "%s sharp scores (q x %.1f): fused vs dequantised-F32 rel err %.3g", ggml_type_name(it), qs, e);
    }
}

// exact rows: the fused kernel with some cells' K/V taken from F16 rows (a recent window, scattered cells, masked
// ones among them, two streams) against F32 attention over the same values: each cell's K/V is either the F16
// row or the packed row's dequantisation. Also a row's output does not change with the rows around it.
static void test_exact_rows(std::mt19937 & rng, int n_head, int n_head_kv) {
    for (ggml_type it : {GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_64})
    for (ggml_type tk : {it, GGML_TYPE_F32})
    for (int n_stream : {1, 2})
    for (int n_q : {1, 5}) {
        const int hs = ggml_rq_iso_qk(it) == 64 ? 64 : 128, n_kv = 200, n_embd = hs*n_head_kv;
        const size_t per_stream = (size_t) hs*n_kv*n_head_kv;
        std::vector<float> q((size_t) hs*n_q*n_head*n_stream), k(per_stream*n_stream), v(k.size());
        fill(q, rng, 1.0f, 1.0f);
        fill(k, rng, 1.0f, 8.0f);
        fill(v, rng, 0.5f, 1.0f);
        // rows 0..n_rows: stream s's cells n_kv-16..n_kv-1 and every 7th cell, exact data the unquantised K/V
        std::vector<int32_t> rows((size_t) n_kv*n_stream, -1);
        std::vector<float> xk, xv;
        for (int s = 0; s < n_stream; ++s) {
            for (int c = 0; c < n_kv; ++c) {
                if (c < n_kv - 16 && c % 7 != 3) {
                    continue;
                }
                rows[(size_t) s*n_kv + c] = (int32_t) (xk.size()/n_embd);
                for (int h = 0; h < n_head_kv; ++h) {
                    const size_t off = (size_t) s*per_stream + ((size_t) h*n_kv + c)*hs;
                    xk.insert(xk.end(), k.begin() + off, k.begin() + off + hs);
                    xv.insert(xv.end(), v.begin() + off, v.begin() + off + hs);
                }
            }
        }
        std::vector<float> mask((size_t) n_kv*n_q, 0.0f);
        for (int i = 0; i < n_q; ++i) {
            for (int c = 0; c < n_kv; ++c) {
                if (c % 11 == 5 || c > n_kv - n_q + i) {
                    mask[(size_t) i*n_kv + c] = -INFINITY; // a hole pattern and a causal tail
                }
            }
        }
        // the reference's K/V: F16-rounded exact rows, the packed rows' dequantisation elsewhere
        std::vector<float> kr = tk == GGML_TYPE_F32 ? k : roundtrip(k, hs, tk), vr = roundtrip(v, hs, it);
        for (int s = 0; s < n_stream; ++s) {
            for (int c = 0; c < n_kv; ++c) {
                const int32_t r = rows[(size_t) s*n_kv + c];
                if (r < 0) {
                    continue;
                }
                for (int h = 0; h < n_head_kv; ++h) {
                    const size_t off = (size_t) s*per_stream + ((size_t) h*n_kv + c)*hs;
                    for (int i = 0; i < hs; ++i) {
                        kr[off + i] = f16_round(xk[(size_t) r*n_embd + h*hs + i]);
                        vr[off + i] = f16_round(xv[(size_t) r*n_embd + h*hs + i]);
                    }
                }
            }
        }
        const char * tn = ggml_type_name(it);
        ggml_rq_counters_reset();
        const std::vector<float> got = attend_x(tk, it, q, k, v, xk, xv, rows, mask, hs, n_q, n_head, n_kv, n_head_kv, n_stream);
        CHECK(ggml_rq_counter_get(GGML_RQ_ISO_DEQUANT_ROWS) == 0, "exact rows: the fused run dequantised rows");
        const std::vector<float> ref = attend_x(GGML_TYPE_F32, GGML_TYPE_F32, q, kr, vr, {}, {}, {}, mask, hs, n_q, n_head, n_kv, n_head_kv, n_stream);
        const double e = rel_err(got, ref);
        CHECK(e < 2e-5, "%s K %s streams=%d n_q=%d: exact rows vs F32 twin rel err %.3g", tn, ggml_type_name(tk), n_stream, n_q, e);
        // and they matter: without them the output is the packed cache's
        const std::vector<float> packed = attend_x(tk, it, q, k, v, {}, {}, {}, mask, hs, n_q, n_head, n_kv, n_head_kv, n_stream);
        CHECK(rel_err(packed, ref) > 10*e + 1e-4, "%s: exact rows changed nothing (%.3g)", tn, rel_err(packed, ref));
        // a window: cell c holds position c, query i position n_kv - n_q + i, and a row counts for a query only within
        // W = 6 positions of it (until = c + W - 1). Reference: each query alone over its own mix of K/V
        if (n_stream == 1) {
            const int W = 6;
            std::vector<int32_t> until(n_kv), q_pos(n_q);
            for (int c = 0; c < n_kv; ++c) until[c] = c + W - 1;
            for (int i = 0; i < n_q; ++i) q_pos[i] = n_kv - n_q + i;
            const std::vector<float> gw = attend_x(tk, it, q, k, v, xk, xv, rows, mask, hs, n_q, n_head, n_kv, n_head_kv, 1, until, q_pos);
            double num = 0, den = 0;
            for (int i = 0; i < n_q; ++i) {
                std::vector<float> qi((size_t) hs*n_head), mi(mask.begin() + (size_t) i*n_kv, mask.begin() + (size_t) (i + 1)*n_kv);
                for (int h = 0; h < n_head; ++h) memcpy(&qi[(size_t) h*hs], &q[((size_t) h*n_q + i)*hs], hs*sizeof(float));
                std::vector<float> ki = tk == GGML_TYPE_F32 ? k : roundtrip(k, hs, tk), vi = roundtrip(v, hs, it);
                for (int c = 0; c < n_kv; ++c) {
                    if (rows[c] < 0 || q_pos[i] > until[c]) continue;
                    for (int h = 0; h < n_head_kv; ++h) {
                        const size_t off = ((size_t) h*n_kv + c)*hs;
                        memcpy(&ki[off], &kr[off], hs*sizeof(float));
                        memcpy(&vi[off], &vr[off], hs*sizeof(float));
                    }
                }
                const std::vector<float> ri = attend_x(GGML_TYPE_F32, GGML_TYPE_F32, qi, ki, vi, {}, {}, {}, mi, hs, 1, n_head, n_kv, n_head_kv, 1);
                for (int h = 0; h < n_head; ++h) {
                    for (int j = 0; j < hs; ++j) {
                        const double a = gw[((size_t) i*n_head + h)*hs + j], b = ri[(size_t) h*hs + j];
                        num += (a - b)*(a - b);
                        den += b*b;
                    }
                }
            }
            const double ew = sqrt(num/(den + 1e-30));
            CHECK(ew < 2e-5, "%s K %s n_q=%d: windowed exact rows vs per-query F32 twin rel err %.3g", tn, ggml_type_name(tk), n_q, ew);
        }
        // the last query row alone gives the same bits as in company
        if (n_q > 1 && n_stream == 1) {
            std::vector<float> q1(q.size()/n_q*1), m1(mask.end() - n_kv, mask.end());
            for (int h = 0; h < n_head; ++h) {
                memcpy(&q1[(size_t) h*hs], &q[((size_t) h*n_q + n_q - 1)*hs], hs*sizeof(float));
            }
            const std::vector<float> one = attend_x(tk, it, q1, k, v, xk, xv, rows, m1, hs, 1, n_head, n_kv, n_head_kv, 1);
            int n_diff = 0;
            for (int h = 0; h < n_head; ++h) {
                // out is [hs, n_head, n_q]: the last token's heads
                n_diff += memcmp(&one[(size_t) h*hs], &got[((size_t) (n_q - 1)*n_head + h)*hs], hs*sizeof(float)) != 0;
            }
            CHECK(n_diff == 0, "%s: the last row alone differs from the same row in company (%d heads)", tn, n_diff);
        }
    }
}

// the AVX-512 twin's K and V of the ISOQUANT3_0/4_0 rows k, v [hs, n_rows_k]
static void avx512_twin_kv(ggml_type it, int hs, size_t n_rows_k, const std::vector<float> & k, const std::vector<float> & v,
                           std::vector<float> & kt, std::vector<float> & vt) {
    const int bits = ggml_rq_iso_bits(it), nb = hs/128;
    // the twin's K: the packed rows decoded with the int8 codebook; V: with the bf16 codebook; both rotated back
    const float * cb = ggml_rq_iso_codebook_bits(bits);
    float cmax = 0.0f;
    for (int l = 0; l < (1 << bits); ++l) cmax = std::max(cmax, fabsf(cb[l]));
    auto decode = [&](const std::vector<float> & x, float (*level)(float, float)) {
        std::vector<uint8_t> packed(ggml_row_size(it, hs)*n_rows_k);
        ggml_quantize_chunk(it, x.data(), packed.data(), 0, (int64_t) n_rows_k, hs, nullptr);
        std::vector<float> y(x.size());
        const size_t bsz = ggml_row_size(it, 128);
        for (size_t r = 0; r < n_rows_k*nb; ++r) {
            const uint8_t * blk = &packed[r*bsz];
            ggml_fp16_t dh;
            memcpy(&dh, blk, sizeof(dh));
            const float d = ggml_fp16_to_fp32(dh);
            float z[128];
            for (int i = 0; i < 128; ++i) {
                const int g = i/8, j = i % 8;
                uint32_t w = 0;
                for (int b = 0; b < bits; ++b) w |= (uint32_t) blk[sizeof(dh) + bits*g + b] << (8*b);
                z[i] = d*level(cb[(w >> (bits*j)) & ((1u << bits) - 1)], cmax);
            }
            ggml_rq_iso_rotate_inv(z, &y[r*128]);
        }
        return y;
    };
    // the int8 levels: round(c L/cmax) with the outer level L <= 127 that moves the levels least (sum of squares)
    static float L8 = 0.0f;
    double emin = INFINITY;
    for (int L = 127; L >= 64; --L) {
        double e = 0.0;
        for (int l = 0; l < (1 << bits); ++l) {
            const double d = (double) (cmax/L)*roundf(cb[l]*L/cmax) - cb[l];
            e += d*d;
        }
        if (e < emin) { emin = e; L8 = (float) L; }
    }
    kt = decode(k, [](float c, float m) { return (m/L8)*roundf(c*L8/m); });
    vt = decode(v, [](float c, float) { return ggml_bf16_to_fp32(ggml_fp32_to_bf16(c)); });
}

static std::vector<float> avx512_twin_query(const std::vector<float> & q) {
    // the twin's query: rotated, rounded to int8 per row and block, scaled back, rotated back
    std::vector<float> qt(q.size());
    for (size_t r = 0; r < q.size()/128; ++r) {
        float y[128];
        ggml_rq_iso_rotate(&q[r*128], y);
        float m = 0.0f;
        for (float x : y) m = std::max(m, fabsf(x));
        const float inv = m > 0.0f ? 127.0f/m : 0.0f;
        for (float & x : y) x = roundf(x*inv)*(m/127.0f);
        ggml_rq_iso_rotate_inv(y, &qt[r*128]);
    }
    return qt;
}

// in double: an exact cell is scored with the query as given (as the kernel does), a packed one with the int8 one
static std::vector<float> avx512_twin(const std::vector<float> & q, const std::vector<float> & qp, const std::vector<float> & kp,
                                      const std::vector<float> & vp, const std::vector<int32_t> & rows,
                                      const std::vector<float> & mask, int hs, int n_q, int nh, int n_kv, int ratio) {
    std::vector<float> out((size_t) hs*nh*n_q);
    std::vector<double> p(n_kv);
    for (int i = 0; i < n_q; ++i) {
        for (int h = 0; h < nh; ++h) {
            const int hk = h/ratio;
            double mx = -INFINITY;
            for (int c = 0; c < n_kv; ++c) {
                const std::vector<float> & qq = rows[c] >= 0 ? q : qp;
                double dot = 0.0;
                for (int e = 0; e < hs; ++e) {
                    dot += (double) qq[((size_t) h*n_q + i)*hs + e]*kp[((size_t) hk*n_kv + c)*hs + e];
                }
                p[c] = dot/sqrt((double) hs) + mask[(size_t) i*n_kv + c];
                mx = std::max(mx, p[c]);
            }
            double sum = 0.0;
            for (int c = 0; c < n_kv; ++c) sum += (p[c] = exp(p[c] - mx));
            for (int e = 0; e < hs; ++e) {
                double acc = 0.0;
                for (int c = 0; c < n_kv; ++c) acc += p[c]*vp[((size_t) hk*n_kv + c)*hs + e];
                out[((size_t) i*nh + h)*hs + e] = (float) (acc/sum);
            }
        }
    }
    return out;
}

// the AVX-512 kernels (VNNI scoring of ISOQUANT3_0/4_0 keys, bf16 V pairs; where the CPU has them) against their
// twin, attention in double with each query row rounded to int8 per 128-value block in the rotated domain, K decoded
// with the int8 codebook (outer level 113 or 112, not 127: iso_cb_u8) and V with the bf16 one: the roundings the
// kernels make (rq-fa-avx512.c: iso_q8_tile, iso_cb_u8, iso_cb_bf16) but the bf16 rounding of each key's weight
// (2^-9 relative), so within 5e-3 (the unfused F16 twin's bound; measured ~1.5e-3). Tile heights 1..8 and a split
// tile (12 heads over 1), partial blocks of keys and an odd key, masked holes, exact rows; a row alone gives the bits
// it gives in company.
static void test_avx512(std::mt19937 & rng) {
    ggml_rq_cpu_set_avx512(true);
    int n_cmp = 0;
    uint64_t n_vnni = 0;
    double sum_e = 0.0, sum_ef = 0.0; // vs the twin, and vs the float kernel's twin (how much the rounding moves)
    for (ggml_type it : {GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_0})
    for (int hs : {128, 256})
    for (int hkv : {1, 2})
    for (int ratio : {1, 2, 3, 5, 6, 8, 12}) {
        const int nh = hkv*ratio, n_kv = 53, n_q = 3;
        const size_t n_rows_k = (size_t) n_kv*hkv;
        std::vector<float> q((size_t) hs*n_q*nh), k(n_rows_k*hs), v(k.size());
        fill(q, rng, 1.0f, 1.0f);
        fill(k, rng, 1.0f, 8.0f);
        fill(v, rng, 0.5f, 1.0f);
        std::vector<float> mask((size_t) n_kv*n_q, 0.0f);
        for (int i = 0; i < n_q; ++i) {
            for (int c = 0; c < n_kv; ++c) {
                if (c % 9 == 4 || c > n_kv - n_q + i) mask[(size_t) i*n_kv + c] = -INFINITY;
            }
        }
        std::vector<int32_t> rows(n_kv, -1);
        std::vector<float> xk, xv;
        if (ratio % 2 == 0) { // every 5th cell exact
            for (int c = 0; c < n_kv; c += 5) {
                rows[c] = (int32_t) (xk.size()/(hs*hkv));
                for (int h = 0; h < hkv; ++h) {
                    const size_t off = ((size_t) h*n_kv + c)*hs;
                    xk.insert(xk.end(), k.begin() + off, k.begin() + off + hs);
                    xv.insert(xv.end(), v.begin() + off, v.begin() + off + hs);
                }
            }
        }
        ggml_rq_counters_reset();
        const std::vector<float> got = attend_x(it, it, q, k, v, xk, xv, rows, mask, hs, n_q, nh, n_kv, hkv, 1);
        n_vnni += ggml_rq_counter_get(GGML_RQ_ISO_AVX512_CALLS);

        std::vector<float> kt, vt;
        avx512_twin_kv(it, hs, n_rows_k, k, v, kt, vt);
        std::vector<float> kf = roundtrip(k, hs, it), vf = roundtrip(v, hs, it);
        // the exact cells: F16 rows in both twins
        for (int c = 0; c < n_kv; ++c) {
            if (rows[c] < 0) continue;
            for (int h = 0; h < hkv; ++h) {
                const size_t off = ((size_t) h*n_kv + c)*hs, xo = ((size_t) rows[c]*hkv + h)*hs;
                for (int i = 0; i < hs; ++i) {
                    kt[off + i] = kf[off + i] = f16_round(xk[xo + i]);
                    vt[off + i] = vf[off + i] = f16_round(xv[xo + i]);
                }
            }
        }
        const std::vector<float> qt = avx512_twin_query(q);
        const std::vector<float> ref = avx512_twin(q, qt, kt, vt, rows, mask, hs, n_q, nh, n_kv, ratio),
                                 reff = avx512_twin(q, q, kf, vf, rows, mask, hs, n_q, nh, n_kv, ratio);
        const bool ran = ggml_rq_counter_get(GGML_RQ_ISO_AVX512_CALLS) > 0 || n_vnni == 0;
        if (n_vnni > 0) {
            const double e = rel_err(got, ref);
            CHECK(ran && e < 5e-3, "%s hs=%d %d heads over %d: AVX-512 kernels vs their twin rel err %.3g", ggml_type_name(it), hs, nh, hkv, e);
            sum_e += e;
            sum_ef += rel_err(got, reff);
        }
        // the last token alone: the same bits
        std::vector<float> q1((size_t) hs*nh), m1(mask.end() - n_kv, mask.end());
        for (int h = 0; h < nh; ++h) memcpy(&q1[(size_t) h*hs], &q[((size_t) h*n_q + n_q - 1)*hs], hs*sizeof(float));
        const std::vector<float> one = attend_x(it, it, q1, k, v, xk, xv, rows, m1, hs, 1, nh, n_kv, hkv, 1);
        CHECK(memcmp(one.data(), &got[(size_t) (n_q - 1)*nh*hs], one.size()*sizeof(float)) == 0,
              "%s hs=%d %d heads over %d: the last row alone differs from the same row in company", ggml_type_name(it), hs, nh, hkv);
        n_cmp++;
    }
    if (n_vnni > 0) {
        // the twin tells the roundings apart: the float kernel's twin is further off (measured 6x)
        CHECK(sum_ef > 3*sum_e, "the AVX-512 kernels are as close to the float twin (%.3g) as to their own (%.3g)", sum_ef, sum_e);
        printf("test-rq-attn: AVX-512 kernels, %d cases: mean rel err %.2g vs their twin, %.2g vs the float one\n",
               n_cmp, sum_e/n_cmp, sum_ef/n_cmp);
    } else {
        printf("test-rq-attn: no AVX-512 VNNI/BF16 on this CPU or build: those kernels were not run (%d cases)\n", n_cmp);
    }
    ggml_rq_cpu_set_avx512(false);
}

// single-token decode over more keys than one chunk (rq-cpu-impl.h: RQ_FA_CHUNK = 1024 visible keys), fewer K/V heads
// than threads: the threads split each head's chunks (ggml_rq_fa_iso_split), and the output must be the bits of one
// thread, which folds the same chunks in the same order, for any thread count; both kernels, masked holes, exact
// rows. Against the dequantised F32 twin the fold must be attention (the float kernels, 2e-5 as above).
static void test_chunked_decode(std::mt19937 & rng) {
    for (bool avx512 : {false, true})
    for (ggml_type tk : {GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_0, GGML_TYPE_F16})
    for (int hkv : {1, 2})
    for (int ratio : {4, 6}) {
        const int hs = 128, nh = hkv*ratio, n_kv = 4500, n_embd = hs*hkv;
        const ggml_type tv = GGML_TYPE_ISOQUANT3_0;
        ggml_rq_cpu_set_avx512(avx512);
        std::vector<float> q((size_t) hs*nh), k((size_t) hs*n_kv*hkv), v(k.size());
        fill(q, rng, 1.0f, 1.0f);
        fill(k, rng, 1.0f, 8.0f);
        fill(v, rng, 0.5f, 1.0f);
        std::vector<float> mask(n_kv, 0.0f);
        for (int c = 0; c < n_kv; ++c) {
            if (c % 13 == 6 || (c > 2000 && c < 2300)) mask[c] = -INFINITY; // holes, and a run of another sequence's cells
        }
        std::vector<int32_t> rows(n_kv, -1);
        std::vector<float> xk, xv;
        for (int c = 0; c < n_kv; ++c) {
            if (c < n_kv - 16 && c % 97 != 5) continue; // a recent window and sparse exact cells
            rows[c] = (int32_t) (xk.size()/n_embd);
            for (int h = 0; h < hkv; ++h) {
                const size_t off = ((size_t) h*n_kv + c)*hs;
                xk.insert(xk.end(), k.begin() + off, k.begin() + off + hs);
                xv.insert(xv.end(), v.begin() + off, v.begin() + off + hs);
            }
        }
        const char * tn = ggml_type_name(tk);
        const std::vector<float> one = attend_x(tk, tv, q, k, v, xk, xv, rows, mask, hs, 1, nh, n_kv, hkv, 1, {}, {}, 1);
        for (int nt : {2, 3, 4, 8}) {
            ggml_rq_counters_reset();
            const std::vector<float> got = attend_x(tk, tv, q, k, v, xk, xv, rows, mask, hs, 1, nh, n_kv, hkv, 1, {}, {}, nt);
            const bool split = ggml_rq_counter_get(GGML_RQ_ISO_SPLIT_CALLS) == 1;
            CHECK(split == (nt/hkv >= 2), "%s %d heads over %d, %d threads: split %d", tn, nh, hkv, nt, (int) split);
            CHECK(memcmp(got.data(), one.data(), one.size()*sizeof(float)) == 0,
                  "%s %d heads over %d, avx512 %d: %d threads differ from one (max |diff| at %g)", tn, nh, hkv, (int) avx512, nt,
                  (double) [&] { float m = 0; for (size_t i = 0; i < one.size(); ++i) m = std::max(m, fabsf(got[i] - one[i])); return m; }());
        }
        if (!avx512 && tk != GGML_TYPE_F16) { // F16 K scores with an F16 query: the twin would need its rounding
            std::vector<float> kr = roundtrip(k, hs, tk), vr = roundtrip(v, hs, tv);
            for (int c = 0; c < n_kv; ++c) {
                if (rows[c] < 0) continue;
                for (int h = 0; h < hkv; ++h) {
                    const size_t off = ((size_t) h*n_kv + c)*hs, xo = ((size_t) rows[c]*hkv + h)*hs;
                    for (int i = 0; i < hs; ++i) {
                        kr[off + i] = f16_round(xk[xo + i]);
                        vr[off + i] = f16_round(xv[xo + i]);
                    }
                }
            }
            const std::vector<float> ref = attend_x(GGML_TYPE_F32, GGML_TYPE_F32, q, kr, vr, {}, {}, {}, mask, hs, 1, nh, n_kv, hkv, 1);
            const double e = rel_err(one, ref);
            CHECK(e < 2e-5, "%s %d heads over %d: chunked decode vs dequantised-F32 twin rel err %.3g", tn, nh, hkv, e);
        }
    }
    ggml_rq_cpu_set_avx512(false);
}

// the ablation switch really skips the inverse rotation (output stays in the rotated domain)
static void test_skip_inverse(std::mt19937 & rng, int n_head, int n_head_kv) {
    const int hs = 128, n_kv = 64, n_q = 1;
    std::vector<float> q((size_t) hs*n_q*n_head), k((size_t) hs*n_kv*n_head_kv), v(k.size());
    fill(q, rng, 1.0f, 1.0f); fill(k, rng, 1.0f, 1.0f); fill(v, rng, 1.0f, 1.0f);
    const std::vector<float> good = attend(GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT3_0, q, k, v, hs, n_q, n_head, n_kv, n_head_kv);
    ggml_rq_iso_set_skip_inverse(true);
    std::vector<float> bad = attend(GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT3_0, q, k, v, hs, n_q, n_head, n_kv, n_head_kv);
    ggml_rq_iso_set_skip_inverse(false);
    for (size_t r = 0; r < bad.size(); r += hs) {
        ggml_rq_iso_rotate_inv(&bad[r], &bad[r]);
    }
    CHECK(rel_err(bad, good) < 1e-5, "skip-inverse output is not R*(fused output)");
}

// the codebook lookup of every SIMD path, bit for bit: the dot product with a one-hot query is one
// codebook value times the block norm, rounded once, whatever the summation order
static void test_codebook_lookup(std::mt19937 & rng) {
    for (ggml_type t : {GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_0, GGML_TYPE_ISOQUANT3_64, GGML_TYPE_ISOQUANT4_64}) {
        const int bits = ggml_rq_iso_bits(t), qk = ggml_rq_iso_qk(t), n = 2*qk;
        const size_t bs = ggml_row_size(t, qk);
        const float * cb = ggml_rq_iso_codebook_qk(bits, qk);
        std::vector<uint8_t> x(2*bs);
        for (auto & b : x) b = (uint8_t) rng();
        const ggml_fp16_t d[2] = { ggml_fp32_to_fp16(0.8125f), ggml_fp32_to_fp16(-3.5f) };
        memcpy(&x[0], &d[0], sizeof(d[0]));
        memcpy(&x[bs], &d[1], sizeof(d[1]));
        const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(t)->vec_dot;
        int n_bad = 0;
        for (int i = 0; i < n; ++i) {
            std::vector<float> q(n, 0.0f);
            q[i] = 1.0f;
            // index k of group g: bits bits*k.. of the little-endian word at qs[bits*g] (ggml-rq/rq-common.h)
            const uint8_t * qs = &x[(i/qk)*bs + sizeof(ggml_fp16_t)];
            const int g = (i % qk)/8, k = i % 8;
            uint32_t w = 0;
            for (int b = 0; b < bits; ++b) w |= (uint32_t) qs[bits*g + b] << (8*b);
            const float want = ggml_fp16_to_fp32(d[i/qk]) * cb[(w >> (bits*k)) & ((1u << bits) - 1)];
            float got;
            vec_dot(n, &got, 0, x.data(), 0, q.data(), 0, 1);
            n_bad += memcmp(&got, &want, sizeof(got)) != 0;
        }
        CHECK(n_bad == 0, "%s vec_dot with one-hot queries: %d of %d lookups not bit-exact", ggml_type_name(t), n_bad, n);
    }
}

int main() {
    ggml_cpu_init();
    std::mt19937 rng(42);
    const int n_head = 4, n_head_kv = 2;

    test_float_kernels(rng, n_head, n_head_kv);
    test_sharp(rng, n_head, n_head_kv);
    test_exact_rows(rng, n_head, n_head_kv);
    test_avx512(rng);
    test_chunked_decode(rng);
    test_skip_inverse(rng, n_head, n_head_kv);
    test_codebook_lookup(rng);

    printf("test-rq-attn: %s (%d failures)\n", n_fail == 0 ? "OK" : "FAILED", n_fail);
    return n_fail == 0 ? 0 : 1;
}
