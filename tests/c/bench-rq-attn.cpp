// One decode step's attention at a model's shape, timed: the fused IsoQuant kernel with and without exact rows (the
// default 16-position window), its AVX-512 kernels against the float ones, with and without the threads splitting a
// head's keys (fewer K/V heads than threads), beside upstream's F16 kernel, with 1 and 2 threads. A benchmark, not a test: it checks
// nothing but prints a table (docs/results/fa-decode-kernel.md). Rows marked "sharp" scale the query 30x: scores of std
// ~30 (sharp attention, as models have at long contexts), where most keys' exps would underflow. test-backend-ops perf covers the op without exact
// rows and on half the hardware threads only; llama-bench times the whole step.
//
// A rep computes one graph of `layers` such ops, each over its own K/V (as a decode step's layers are), so that with
// as many layers as the model has the caches do not stay in L3 between reps; times are per op.
//
//   bench-rq-attn [n_kv [n_head [n_head_kv [reps [layers]]]]]   (defaults: 32768 12 2 10 28, Qwen2.5-1.5B's decode)

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-rq.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

struct cfg {
    const char * name;
    ggml_type    type;
    int          window; // cells at the end of the cache taken from exact F16 rows (0: none)
    bool         cells;  // K/V stored as llama's cache stores them, [hs, n_head_kv, n_kv] (a cell's heads adjacent)
                         // and viewed per head; otherwise each head's cells contiguous
    bool         avx2;   // the float kernels even where the CPU has the AVX-512 ones (ggml_rq_cpu_set_avx512(false))
    bool         rows;   // threads split the heads' rows only, not a head's keys (ggml_rq_cpu_set_split(false))
    float        qscale; // the query's scale: 1 gives scores of std ~1; 30, scores of std ~30, most keys far below the
                         // row's max (sharp attention, where an exp that underflows to a denormal costs a microcode
                         // assist unless flushed)
};

// a graph of `layers` FLASH_ATTN_EXT ops, each over its own K/V, in its own context
static ggml_cgraph * build(const cfg & c, int n_kv, int n_head, int n_head_kv, int layers, ggml_context ** pctx) {
    const int hs = 128;
    const size_t kv = 2*ggml_row_size(c.type, hs)*n_kv*n_head_kv + (size_t) n_kv*(2 + 8) + 2*ggml_row_size(GGML_TYPE_F16, hs*n_head_kv)*c.window;
    ggml_init_params ip = { (size_t) layers*(kv + 64*1024) + 64*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> buf((size_t) n_kv*hs*n_head_kv);
    auto make = [&](void) {
        for (auto & x : buf) x = nd(rng);
        ggml_tensor * t = c.cells ? ggml_new_tensor_3d(ctx, c.type, hs, n_head_kv, n_kv) : ggml_new_tensor_3d(ctx, c.type, hs, n_kv, n_head_kv);
        if (c.type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(buf.data(), (ggml_fp16_t *) t->data, (int64_t) buf.size());
        } else {
            ggml_quantize_chunk(c.type, buf.data(), t->data, 0, (int64_t) n_kv*n_head_kv, hs, nullptr);
        }
        return c.cells ? ggml_permute(ctx, t, 0, 2, 1, 3) : t;
    };
    ggml_cgraph * gf = ggml_new_graph(ctx);
    for (int l = 0; l < layers; ++l) {
        ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hs, 1, n_head);
        for (int64_t i = 0; i < ggml_nelements(q); ++i) ((float *) q->data)[i] = c.qscale*nd(rng);
        ggml_tensor * k = make();
        ggml_tensor * v = make();
        ggml_tensor * m = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, 1);
        memset(m->data, 0, ggml_nbytes(m)); // every cell visible, as in a single sequence's decode step
        ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f/sqrtf((float) hs), 0.0f, 0.0f);
        ggml_prec_set_acc(out, GGML_PREC_F32);
        if (c.window > 0) {
            // as llama's window sets it: rows for the last cells, valid until a position past the query's
            ggml_tensor * kx = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, hs*n_head_kv, c.window);
            ggml_tensor * vx = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, hs*n_head_kv, c.window);
            ggml_tensor * rows = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, 1);
            ggml_tensor * until = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, 1);
            ggml_tensor * qpos = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 1);
            for (int64_t i = 0; i < ggml_nelements(kx); ++i) {
                ((ggml_fp16_t *) kx->data)[i] = ggml_fp32_to_fp16(nd(rng));
                ((ggml_fp16_t *) vx->data)[i] = ggml_fp32_to_fp16(nd(rng));
            }
            for (int i = 0; i < n_kv; ++i) {
                const bool x = i >= n_kv - c.window;
                ((int32_t *) rows->data)[i]  = x ? i - (n_kv - c.window) : -1;
                ((int32_t *) until->data)[i] = x ? i + c.window : -1;
            }
            ((int32_t *) qpos->data)[0] = n_kv;
            ggml_rq_flash_attn_ext_set_exact(out, kx, vx, rows, until, qpos);
        }
        ggml_build_forward_expand(gf, out);
    }
    *pctx = ctx;
    return gf;
}

int main(int argc, char ** argv) {
    const int n_kv      = argc > 1 ? atoi(argv[1]) : 32768;
    const int n_head    = argc > 2 ? atoi(argv[2]) : 12;
    const int n_head_kv = argc > 3 ? atoi(argv[3]) : 2;
    const int reps      = argc > 4 ? atoi(argv[4]) : 10;
    const int layers    = argc > 5 ? atoi(argv[5]) : 28;
    if (n_kv < 32 || n_head < 1 || n_head_kv < 1 || n_head % n_head_kv || reps < 1 || layers < 1) {
        fprintf(stderr, "usage: %s [n_kv >= 32 [n_head [n_head_kv dividing n_head [reps [layers]]]]]\n", argv[0]);
        return 1;
    }
    const cfg cfgs[] = {
        { "f16, cache layout",                        GGML_TYPE_F16,         0,  true,  false, false, 1.0f  },
        { "isoquant3_0, heads contiguous",            GGML_TYPE_ISOQUANT3_0, 0,  false, false, false, 1.0f  },
        { "isoquant3_0, cache layout, float",         GGML_TYPE_ISOQUANT3_0, 0,  true,  true,  false, 1.0f  },
        { "isoquant3_0, cache layout",                GGML_TYPE_ISOQUANT3_0, 0,  true,  false, false, 1.0f  },
        { "isoquant3_0 w16, cache layout, float",     GGML_TYPE_ISOQUANT3_0, 16, true,  true,  false, 1.0f  },
        { "isoquant3_0 w16, cache layout",            GGML_TYPE_ISOQUANT3_0, 16, true,  false, false, 1.0f  },
        { "isoquant3_0 w16, cache layout, rows only", GGML_TYPE_ISOQUANT3_0, 16, true,  false, true,  1.0f  },
        { "isoquant3_0 w16, cache layout, float, sharp", GGML_TYPE_ISOQUANT3_0, 16, true, true,  false, 30.0f },
        { "isoquant3_0 w16, cache layout, sharp",     GGML_TYPE_ISOQUANT3_0, 16, true,  false, false, 30.0f },
    };
    printf("FLASH_ATTN_EXT, one query token, head size 128, %d query heads over %d KV heads, %d cells; %d reps of "
           "%d ops, each over its own K/V, configurations interleaved; ms per op\n\n", n_head, n_head_kv, n_kv, reps, layers);
    // rounds outer, configurations inner: this VM's slow phases last longer than one configuration's reps
    const int n_cfg = (int) (sizeof(cfgs)/sizeof(cfgs[0]));
    ggml_context * ctx[n_cfg];
    ggml_cgraph  * gf[n_cfg];
    for (int i = 0; i < n_cfg; ++i) {
        gf[i] = build(cfgs[i], n_kv, n_head, n_head_kv, layers, &ctx[i]);
    }
    const int threads[] = { 1, 2 };
    std::vector<double> ms[n_cfg][2];
    for (int r = 0; r <= reps; ++r) {
        for (int it = 0; it < 2; ++it) {
            for (int i = 0; i < n_cfg; ++i) {
                ggml_rq_cpu_set_avx512(!cfgs[i].avx2);
                ggml_rq_cpu_set_split(!cfgs[i].rows);
                const auto t0 = std::chrono::steady_clock::now();
                ggml_graph_compute_with_ctx(ctx[i], gf[i], threads[it]);
                const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
                if (r > 0) ms[i][it].push_back(dt/layers); // round 0 warms up
            }
        }
    }
    ggml_rq_cpu_set_avx512(true);
    ggml_rq_cpu_set_split(true);
    // rows without ", float" take the AVX-512 kernels (VNNI scores, bf16 V) where this CPU has them
    printf("IsoQuant kernels: %s\n\n", ggml_rq_counter_get(GGML_RQ_ISO_AVX512_CALLS) > 0
                                          ? "AVX-512 (VNNI scores, bf16 V) where not marked float"
                                          : "float everywhere (no AVX-512 VNNI/BF16 on this CPU)");
    printf("| cache | threads | best ms | median ms | ns per key and KV head (thread time, median) |\n");
    printf("|---|---:|---:|---:|---:|\n");
    for (int it = 0; it < 2; ++it) {
        for (int i = 0; i < n_cfg; ++i) {
            std::vector<double> & x = ms[i][it];
            std::sort(x.begin(), x.end());
            const double med = x[x.size()/2];
            printf("| %s | %d | %.3f | %.3f | %.1f |\n", cfgs[i].name, threads[it], x.front(), med,
                   med*1e6*threads[it]/((double) n_kv*n_head_kv));
        }
    }
    for (int i = 0; i < n_cfg; ++i) {
        ggml_free(ctx[i]);
    }
    return 0;
}
