// ITQ3_S matmul against its slow twin.
//
// The fast path rotates each activation row once (Q8_ITQ: signs, FWHT-256, 8-bit) and takes integer
// dot products with the packed codes, never inverse-transforming a weight. The twin dequantises the
// weights with to_float (bit-exact with the numpy reference) and multiplies in double. They may
// differ only by the 8-bit activation rounding (checked against the same rounding of Q8_K on
// unrotated activations, which upstream's k-quants accept).

#include "ggml.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static int n_fail = 0;
#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); ++n_fail; } } while (0)

static std::vector<float> matmul(ggml_type tw, const std::vector<float> & w, const std::vector<float> & x, int k, int m, int n, int threads) {
    ggml_init_params ip = { 64u*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * tw_ = ggml_new_tensor_2d(ctx, tw, k, m);
    if (tw == GGML_TYPE_F32) {
        memcpy(tw_->data, w.data(), ggml_nbytes(tw_));
    } else {
        ggml_quantize_chunk(tw, w.data(), tw_->data, 0, m, k, nullptr);
    }
    ggml_tensor * tx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    memcpy(tx->data, x.data(), ggml_nbytes(tx));
    ggml_tensor * out = ggml_mul_mat(ctx, tw_, tx);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, threads);
    std::vector<float> res(ggml_nelements(out));
    memcpy(res.data(), out->data, ggml_nbytes(out));
    ggml_free(ctx);
    return res;
}

int main() {
    ggml_cpu_init();
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::student_t_distribution<float> td(3.0f);

    for (int k : {256, 1536, 4096}) {
        // n >= 8: ggml-cpu's tiled matmul (rq-tiled.h) on x86, n <= 16 its narrow path; m = 40 and n = 20
        // leave ragged 16x16 microtiles
        for (int n : {1, 5, 8, 20, 64}) {
            const int m = k == 1536 ? 40 : 48;
            std::vector<float> w((size_t) k*m), x((size_t) k*n);
            for (auto & v : w) v = 0.02f*td(rng);
            for (auto & v : x) v = nd(rng);
            for (int j = 7; j < k; j += 97) for (int r = 0; r < n; ++r) x[(size_t) r*k + j] *= 20.0f; // outlier channels

            // the twin: dequantised weights, double-precision dot products
            std::vector<uint8_t> packed(ggml_row_size(GGML_TYPE_ITQ3_S, k) * m);
            ggml_quantize_chunk(GGML_TYPE_ITQ3_S, w.data(), packed.data(), 0, m, k, nullptr);
            std::vector<float> wd(w.size());
            ggml_get_type_traits(GGML_TYPE_ITQ3_S)->to_float(packed.data(), wd.data(), (int64_t) w.size());
            std::vector<double> ref((size_t) m*n);
            for (int r = 0; r < n; ++r)
                for (int i = 0; i < m; ++i) {
                    double s = 0;
                    for (int j = 0; j < k; ++j) s += (double) wd[(size_t) i*k + j] * x[(size_t) r*k + j];
                    ref[(size_t) r*m + i] = s;
                }

            const std::vector<float> fast = matmul(GGML_TYPE_ITQ3_S, w, x, k, m, n, 2);
            const std::vector<float> deq  = matmul(GGML_TYPE_F32, wd, x, k, m, n, 2);
            double e_fast = 0, e_deq = 0, den = 0;
            for (size_t i = 0; i < ref.size(); ++i) {
                e_fast += (fast[i] - ref[i])*(fast[i] - ref[i]);
                e_deq  += (deq[i]  - ref[i])*(deq[i]  - ref[i]);
                den    += ref[i]*ref[i];
            }
            e_fast = sqrt(e_fast/den);
            e_deq  = sqrt(e_deq/den);
            // 7-bit activations after the FWHT (Q8_ITQ): ~1% of the output; F32 twin: rounding only
            if (getenv("RQ_VERBOSE")) printf("k=%d n=%d fused %.3g f32 %.3g\n", k, n, e_fast, e_deq);
            CHECK(e_fast < 2e-2, "k=%d n=%d: fused ITQ3_S matmul vs dequantised twin rel err %.3g", k, n, e_fast);
            CHECK(e_deq < 1e-5, "k=%d n=%d: F32 matmul of the dequantised weights rel err %.3g", k, n, e_deq);

            // the vec_dot twin on the same Q8_ITQ activations: per output one ggml_vec_dot_itq3_s_q8_itq call.
            // The tiled path takes the same integer sums (exact) and differs only in float rounding.
            {
                const auto * tq = ggml_get_type_traits_cpu(GGML_TYPE_Q8_ITQ);
                const ggml_vec_dot_t vd = ggml_get_type_traits_cpu(GGML_TYPE_ITQ3_S)->vec_dot;
                const size_t rs = ggml_row_size(GGML_TYPE_Q8_ITQ, k), ws = ggml_row_size(GGML_TYPE_ITQ3_S, k);
                std::vector<uint8_t> xq(rs*n);
                for (int r = 0; r < n; ++r) tq->from_float(&x[(size_t) r*k], xq.data() + r*rs, k);
                // the tiled path's maddubs pairs (weights up to 254) need 7-bit activation codes; bsums match
                const size_t bsz = ggml_type_size(GGML_TYPE_Q8_ITQ);
                for (size_t b = 0; b < xq.size()/bsz; ++b) {
                    const int8_t  * qs = (const int8_t  *) (xq.data() + b*bsz + 4);
                    const int16_t * bs = (const int16_t *) (xq.data() + b*bsz + 4 + 256);
                    for (int j = 0; j < 16; ++j) {
                        int sum = 0;
                        for (int i = 0; i < 16; ++i) {
                            CHECK(qs[16*j + i] >= -63 && qs[16*j + i] <= 63, "Q8_ITQ code %d out of 7 bits", qs[16*j + i]);
                            sum += qs[16*j + i];
                        }
                        CHECK(sum == bs[j], "Q8_ITQ bsum %d != %d", bs[j], sum);
                    }
                }
                double e = 0, d = 0;
                for (int r = 0; r < n; ++r)
                    for (int i = 0; i < m; ++i) {
                        float v;
                        vd(k, &v, 0, packed.data() + i*ws, 0, xq.data() + r*rs, 0, 1);
                        e += (fast[(size_t) r*m + i] - v)*(fast[(size_t) r*m + i] - v);
                        d += (double) v*v;
                    }
                CHECK(sqrt(e/d) < 1e-6, "k=%d n=%d: matmul vs per-output vec_dot rel err %.3g", k, n, sqrt(e/d));
            }

            // same result with one thread (the per-row activation conversion is chunked by threads)
            const std::vector<float> one = matmul(GGML_TYPE_ITQ3_S, w, x, k, m, n, 1);
            CHECK(memcmp(one.data(), fast.data(), fast.size()*sizeof(float)) == 0, "k=%d n=%d: 1 vs 2 threads differ", k, n);
        }
    }
    // vec_dot's integer part, bit for bit, on every SIMD path: with d = 1, m = 0 (and d = 0, m = 1) and
    // an activation scale of 1 the result is sum grid[q_i]*y_i (sum y_i), exact in float (< 2^24)
    {
        struct q8k { float d; int8_t qs[256]; int16_t bsums[16]; };   // block_q8_K (ggml-common.h)
        CHECK(sizeof(q8k) == ggml_type_size(GGML_TYPE_Q8_ITQ), "block_q8_K layout changed");
        const size_t bs = ggml_type_size(GGML_TYPE_ITQ3_S);          // d, m (fp16), qs[64], qh[32]
        CHECK(bs == 4 + 64 + 32, "block_itq3_s layout changed");
        // the grid from the reference dequantiser: constant codes q dequantise to S FWHT256(grid[q]),
        // i.e. 16*grid[q]*s_0 at index 0; d = 0, m = 1 gives 16*s_0
        auto deq0 = [&](int q, float d, float m) {
            std::vector<uint8_t> b(bs);
            const ggml_fp16_t h[2] = { ggml_fp32_to_fp16(d), ggml_fp32_to_fp16(m) };
            memcpy(b.data(), h, sizeof(h));
            memset(&b[4], (q & 3)*0x55, 64);
            memset(&b[68], q & 4 ? 0xff : 0, 32);
            std::vector<float> v(256);
            ggml_get_type_traits(GGML_TYPE_ITQ3_S)->to_float(b.data(), v.data(), 256);
            return v[0];
        };
        int grid[8];
        for (int q = 0; q < 8; ++q) grid[q] = (int) lrintf(deq0(q, 1.0f, 0.0f)/deq0(0, 0.0f, 1.0f));
        const int nb = 3;
        std::vector<uint8_t> x(nb*bs);
        std::vector<q8k> y(nb);
        for (auto & b : x) b = (uint8_t) rng();
        int64_t isum = 0, qsum = 0;
        for (int ib = 0; ib < nb; ++ib) {
            y[ib].d = 1.0f;
            for (int i = 0; i < 256; ++i) y[ib].qs[i] = (int8_t) ((int) (rng() % 255) - 127);
            for (int j = 0; j < 16; ++j) {
                int s = 0;
                for (int i = 0; i < 16; ++i) s += y[ib].qs[16*j + i];
                y[ib].bsums[j] = (int16_t) s;
            }
            const uint8_t * qs = &x[ib*bs + 4], * qh = &x[ib*bs + 68];
            for (int i = 0; i < 256; ++i) {
                const int q = ((qs[i % 64] >> (2*(i/64))) & 3) | (((qh[i % 32] >> (i/32)) & 1) << 2);
                isum += grid[q]*y[ib].qs[i];
                qsum += y[ib].qs[i];
            }
        }
        const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(GGML_TYPE_ITQ3_S)->vec_dot;
        for (int part = 0; part < 2; ++part) {
            const ggml_fp16_t h[2] = { ggml_fp32_to_fp16(part == 0 ? 1.0f : 0.0f), ggml_fp32_to_fp16(part == 0 ? 0.0f : 1.0f) };
            for (int ib = 0; ib < nb; ++ib) memcpy(&x[ib*bs], h, sizeof(h));
            float got;
            vec_dot(nb*256, &got, 0, x.data(), 0, y.data(), 0, 1);
            const int64_t want = part == 0 ? isum : qsum;
            CHECK(got == (float) want, "itq3_s vec_dot %s part: %.1f, want %lld", part == 0 ? "grid" : "offset", got, (long long) want);
        }
    }

    printf("test-rq-itq3: %s (%d failures)\n", n_fail == 0 ? "OK" : "FAILED", n_fail);
    return n_fail == 0 ? 0 : 1;
}
