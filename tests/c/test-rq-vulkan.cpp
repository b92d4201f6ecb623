// The IsoQuant Vulkan kernels against the C reference, on whatever Vulkan device is present (lavapipe in CI).
//
// Quantising (SET_ROWS with I32 and I64 rows, CPY F32 -> ISO) must give the reference quantiser's blocks byte
// for byte; dequantising (GET_ROWS -> F32/F16, CPY ISO -> F32/F16) the reference dequantiser's floats bit for bit
// (F16: the CPU's round-to-nearest-even of them); ITQ3_S's GET_ROWS too. Rows include the edges: zero, tiny (subnormal fp16 scale),
// huge (scale clamped at 65504), one hot channel. A fused flash-attention run must count as fused on the Vulkan
// backend and dequantise nothing.
//
//   test-rq-vulkan [device index]     (exit 0 with "skipped" when no Vulkan device exists)

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rq.h"
#include "ggml-vulkan.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

extern "C" uint64_t ggml_rq_vk_fused_calls(void);

static int n_fail = 0;

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); ++n_fail; } } while (0)

static const ggml_type ISO_TYPES[] = { GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ISOQUANT4_0, GGML_TYPE_ISOQUANT3_64, GGML_TYPE_ISOQUANT4_64 };

// n rows of ne0 values: random rows with a hot channel, and the edge rows
static std::vector<float> make_rows(int64_t ne0, int64_t n, std::mt19937 & rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(ne0*n);
    for (int64_t r = 0; r < n; ++r) {
        float * row = x.data() + r*ne0;
        const float scale = r == 0 ? 0.0f : r == 1 ? 1e-9f : r == 2 ? 3e5f : 0.5f + (float) (r % 7);
        for (int64_t i = 0; i < ne0; ++i) {
            row[i] = scale*nd(rng);
        }
        if (r % 5 == 3) {
            row[r % ne0] *= 40.0f;
        }
    }
    return x;
}

// build one graph on `backend`, upload inputs with `set`, compute, read the output's bytes
static std::vector<uint8_t> run(ggml_backend_t backend, const std::function<ggml_tensor *(ggml_context *)> & build,
                                const std::function<void(ggml_context *)> & set) {
    ggml_init_params ip = { 64*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * out = build(ctx);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    set(ctx);
    const ggml_status st = ggml_backend_graph_compute(backend, gf);
    CHECK(st == GGML_STATUS_SUCCESS, "graph compute failed (%d)", (int) st);
    std::vector<uint8_t> bytes(ggml_nbytes(out));
    ggml_backend_tensor_get(out, bytes.data(), 0, bytes.size());
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return bytes;
}

// CPY F32 -> t of n rows of ne0 floats on the device: the packed bytes
static std::vector<uint8_t> cpy_quantise(ggml_backend_t vk, ggml_type t, const std::vector<float> & x, int64_t ne0, int64_t n) {
    return run(vk, [&](ggml_context * ctx) {
        ggml_tensor * src = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ne0, n);
        ggml_set_name(src, "src");
        return ggml_cpy(ctx, src, ggml_new_tensor_2d(ctx, t, ne0, n));
    }, [&](ggml_context * ctx) {
        ggml_backend_tensor_set(ggml_get_tensor(ctx, "src"), x.data(), 0, x.size()*sizeof(float));
    });
}

static void test_quantise(ggml_backend_t vk, ggml_type t, std::mt19937 & rng) {
    const int64_t qk = ggml_blck_size(t), ne0 = 2*qk, n = 12, n_dst = 16;
    const std::vector<float> x = make_rows(ne0, n, rng);
    // the reference: row r of x lands in row dst_row[r]
    std::vector<int64_t> dst_row(n);
    for (int64_t r = 0; r < n; ++r) {
        dst_row[r] = (r*5 + 3) % n_dst;
    }
    const size_t rs = ggml_row_size(t, ne0);
    std::vector<uint8_t> want(rs*n_dst, 0);
    for (int64_t r = 0; r < n; ++r) {
        ggml_quantize_chunk(t, x.data() + r*ne0, want.data() + dst_row[r]*rs, 0, 1, ne0, nullptr);
    }
    for (ggml_type it : { GGML_TYPE_I32, GGML_TYPE_I64 }) {
        const auto got = run(vk, [&](ggml_context * ctx) {
            ggml_tensor * dst = ggml_new_tensor_2d(ctx, t, ne0, n_dst);
            ggml_set_name(dst, "dst");
            ggml_tensor * src = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ne0, n);
            ggml_set_name(src, "src");
            ggml_tensor * idx = ggml_new_tensor_1d(ctx, it, n);
            ggml_set_name(idx, "idx");
            return ggml_set_rows(ctx, dst, src, idx);
        }, [&](ggml_context * ctx) {
            ggml_tensor * dst = ggml_get_tensor(ctx, "dst");
            ggml_backend_tensor_set(dst, want.data(), 0, want.size()); // rows not written keep these bytes
            std::vector<uint8_t> zero(rs, 0);
            for (int64_t r = 0; r < n; ++r) {
                ggml_backend_tensor_set(dst, zero.data(), dst_row[r]*rs, rs);
            }
            ggml_backend_tensor_set(ggml_get_tensor(ctx, "src"), x.data(), 0, x.size()*sizeof(float));
            ggml_tensor * idx = ggml_get_tensor(ctx, "idx");
            if (it == GGML_TYPE_I32) {
                std::vector<int32_t> v(dst_row.begin(), dst_row.end());
                ggml_backend_tensor_set(idx, v.data(), 0, v.size()*sizeof(int32_t));
            } else {
                ggml_backend_tensor_set(idx, dst_row.data(), 0, dst_row.size()*sizeof(int64_t));
            }
        });
        size_t bad = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            bad += got[i] != want[i];
        }
        CHECK(bad == 0, "SET_ROWS F32 -> %s (%s rows): %zu of %zu bytes differ from the reference quantiser",
              ggml_type_name(t), ggml_type_name(it), bad, want.size());
    }
    // CPY F32 -> ISO: the whole tensor in element order
    std::vector<uint8_t> want_cpy(rs*n);
    ggml_quantize_chunk(t, x.data(), want_cpy.data(), 0, n, ne0, nullptr);
    const auto got = cpy_quantise(vk, t, x, ne0, n);
    CHECK(got == want_cpy, "CPY F32 -> %s differs from the reference quantiser", ggml_type_name(t));
}

// The index of value i of a packed IsoQuant block (after its fp16 scale): group i/8 is the bits-byte little-endian word
// at byte 2 + bits*(i/8)
static int iso_index(const uint8_t * blk, int bits, int i) {
    const uint8_t * p = blk + 2 + bits*(i/8);
    uint32_t w = 0;
    for (int b = 0; b < bits; ++b) {
        w |= (uint32_t) p[b] << (8*b);
    }
    return (int) ((w >> (bits*(i % 8))) & ((1u << bits) - 1));
}

// Many blocks of test-backend-ops' data (uniform in [-1, 1]), byte for byte. A rounding difference in the device's
// rotation shows only where a rotated value lies within an ulp of a decision bound (~1e-7 of values), so the 24 blocks
// above cannot catch it: lavapipe folding the WHT scale into the SO(4) constants despite `precise` flipped 1 and 3
// blocks of these 262144 (isoquant3_0, isoquant4_0) and failed test-backend-ops' SET_ROWS in ~4% of runs.
static void test_quantise_sweep(ggml_backend_t vk, ggml_type t, std::mt19937 & rng) {
    const int    bits = (t == GGML_TYPE_ISOQUANT3_0 || t == GGML_TYPE_ISOQUANT3_64) ? 3 : 4;
    const int    qk = (int) ggml_blck_size(t);
    const int64_t ne0 = 8*qk, n = (getenv("RQ_SWEEP") ? atoi(getenv("RQ_SWEEP")) : 262144)*qk/ne0;
    std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
    std::vector<float> x(ne0*n);
    for (float & v : x) {
        v = ud(rng);
    }
    std::vector<uint8_t> want(ggml_row_size(t, ne0)*n);
    ggml_quantize_chunk(t, x.data(), want.data(), 0, n, ne0, nullptr);
    const auto got = cpy_quantise(vk, t, x, ne0, n);
    const size_t bs = ggml_type_size(t), nblk = want.size()/bs;
    size_t bad = 0;
    for (size_t b = 0; b < nblk; ++b) {
        const uint8_t * wb = want.data() + b*bs, * gb = got.data() + b*bs;
        if (memcmp(wb, gb, bs) == 0 || bad++ > 0) {
            continue;
        }
        // the first bad block: which indices differ, and how far the reference's rotated value lies from a bound
        int ndiff = 0, at = -1;
        for (int i = 0; i < qk; ++i) {
            if (iso_index(wb, bits, i) != iso_index(gb, bits, i)) {
                ++ndiff;
                at = i;
            }
        }
        const float * xb = x.data() + b*qk;
        double ss = 0.0;
        for (int i = 0; i < qk; ++i) {
            ss += (double) xb[i]*xb[i];
        }
        float xh[128], yr[128];
        for (int i = 0; i < qk; ++i) {
            xh[i] = (float) (xb[i]/sqrt(ss));
        }
        ggml_rq_iso_rotate_qk(xh, yr, qk);
        const float * cb = ggml_rq_iso_codebook_qk(bits, qk);
        const int lo = std::min(iso_index(wb, bits, at), iso_index(gb, bits, at));
        const float mid = 0.5f*(cb[lo] + cb[lo + 1]);
        fprintf(stderr, "  %s block %zu: %d indices differ; value %d (index %d here, %d on the device) lies %.1f ulp from "
                "the levels' midpoint\n", ggml_type_name(t), b, ndiff, at, iso_index(wb, bits, at), iso_index(gb, bits, at),
                (yr[at] - mid)/(nextafterf(fabsf(mid), INFINITY) - fabsf(mid)));
    }
    CHECK(bad == 0, "CPY F32 -> %s, uniform rows: %zu of %zu blocks differ from the reference quantiser",
          ggml_type_name(t), bad, nblk);
}

// GET_ROWS (ggml_get_rows gives F32) of the packed rows q must give their reference dequantisation deq bit for bit
static void check_get_rows(ggml_backend_t vk, ggml_type t, const std::vector<uint8_t> & q, const std::vector<float> & deq,
                           int64_t ne0, int64_t n, const std::vector<int32_t> & rows) {
    const auto got = run(vk, [&](ggml_context * ctx) {
        ggml_tensor * src = ggml_new_tensor_2d(ctx, t, ne0, n);
        ggml_set_name(src, "src");
        ggml_tensor * idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) rows.size());
        ggml_set_name(idx, "idx");
        return ggml_get_rows(ctx, src, idx);
    }, [&](ggml_context * ctx) {
        ggml_backend_tensor_set(ggml_get_tensor(ctx, "src"), q.data(), 0, q.size());
        ggml_backend_tensor_set(ggml_get_tensor(ctx, "idx"), rows.data(), 0, rows.size()*sizeof(int32_t));
    });
    bool same = true;
    for (size_t r = 0; r < rows.size(); ++r) {
        same &= memcmp(got.data() + r*ne0*sizeof(float), deq.data() + rows[r]*ne0, ne0*sizeof(float)) == 0;
    }
    CHECK(same, "GET_ROWS %s -> F32 differs from the reference dequantiser", ggml_type_name(t));
}

static void test_dequantise(ggml_backend_t vk, ggml_type t, std::mt19937 & rng) {
    const int64_t qk = ggml_blck_size(t), ne0 = 2*qk, n = 12;
    const std::vector<float> x = make_rows(ne0, n, rng);
    const size_t rs = ggml_row_size(t, ne0);
    std::vector<uint8_t> q(rs*n);
    ggml_quantize_chunk(t, x.data(), q.data(), 0, n, ne0, nullptr);
    std::vector<float> deq(ne0*n);
    ggml_get_type_traits(t)->to_float(q.data(), deq.data(), ne0*n);
    std::vector<ggml_fp16_t> deq16(ne0*n);
    ggml_fp32_to_fp16_row(deq.data(), deq16.data(), ne0*n);
    const std::vector<int32_t> rows = { 5, 0, 11, 2, 2, 7 };

    check_get_rows(vk, t, q, deq, ne0, n, rows);

    for (ggml_type dt : { GGML_TYPE_F32, GGML_TYPE_F16 }) {
        // CPY ISO -> F32/F16 (the unfused path's cast)
        const auto got_cpy = run(vk, [&](ggml_context * ctx) {
            ggml_tensor * src = ggml_new_tensor_2d(ctx, t, ne0, n);
            ggml_set_name(src, "src");
            return ggml_cpy(ctx, src, ggml_new_tensor_2d(ctx, dt, ne0, n));
        }, [&](ggml_context * ctx) {
            ggml_backend_tensor_set(ggml_get_tensor(ctx, "src"), q.data(), 0, q.size());
        });
        const void * want = dt == GGML_TYPE_F32 ? (const void *) deq.data() : (const void *) deq16.data();
        CHECK(memcmp(got_cpy.data(), want, got_cpy.size()) == 0, "CPY %s -> %s differs from the reference dequantiser",
              ggml_type_name(t), ggml_type_name(dt));
    }
}

// ITQ3_S: GET_ROWS gives dequantize_row_itq3_s's floats bit for bit (the F16 dequantiser MUL_MAT uses shares its
// code; test-backend-ops checks MUL_MAT)
static void test_itq3_get_rows(ggml_backend_t vk, std::mt19937 & rng) {
    const ggml_type t = GGML_TYPE_ITQ3_S;
    const int64_t ne0 = 512, n = 8;
    const std::vector<float> x = make_rows(ne0, n, rng);
    std::vector<uint8_t> q(ggml_row_size(t, ne0)*n);
    ggml_quantize_chunk(t, x.data(), q.data(), 0, n, ne0, nullptr);
    std::vector<float> deq(ne0*n);
    ggml_get_type_traits(t)->to_float(q.data(), deq.data(), ne0*n);
    check_get_rows(vk, t, q, deq, ne0, n, { 7, 0, 3, 3 });
}

// the fused kernel runs on the device, counts as fused there, and dequantises nothing
static void test_fused_counts(ggml_backend_t vk, std::mt19937 & rng) {
    const int64_t hs = 128, n_kv = 96, n_head = 4, n_head_kv = 2;
    const ggml_type t = GGML_TYPE_ISOQUANT3_0;
    std::vector<float> q = make_rows(hs, n_head, rng), kv = make_rows(hs, n_kv*n_head_kv, rng);
    std::vector<uint8_t> pk(ggml_row_size(t, hs)*n_kv*n_head_kv);
    ggml_quantize_chunk(t, kv.data(), pk.data(), 0, n_kv*n_head_kv, hs, nullptr);
    ggml_rq_counters_reset();
    const uint64_t vk0 = ggml_rq_vk_fused_calls();
    const auto out = run(vk, [&](ggml_context * ctx) {
        ggml_tensor * tq = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hs, 1, n_head);
        ggml_set_name(tq, "q");
        ggml_tensor * tk = ggml_new_tensor_3d(ctx, t, hs, n_kv, n_head_kv);
        ggml_set_name(tk, "k");
        return ggml_flash_attn_ext(ctx, tq, tk, tk, nullptr, 1.0f/sqrtf((float) hs), 0.0f, 0.0f);
    }, [&](ggml_context * ctx) {
        ggml_backend_tensor_set(ggml_get_tensor(ctx, "q"), q.data(), 0, q.size()*sizeof(float));
        ggml_backend_tensor_set(ggml_get_tensor(ctx, "k"), pk.data(), 0, pk.size());
    });
    const uint64_t fused = ggml_rq_vk_fused_calls() - vk0;
    CHECK(fused == 1, "fused flash attention on Vulkan: %llu calls counted, want 1", (unsigned long long) fused);
    CHECK(ggml_rq_counter_get(GGML_RQ_ISO_DEQUANT_ROWS) == 0, "the fused run dequantised %llu blocks",
          (unsigned long long) ggml_rq_counter_get(GGML_RQ_ISO_DEQUANT_ROWS));
    bool finite = true;
    for (size_t i = 0; i < out.size()/sizeof(float); ++i) {
        finite &= std::isfinite(((const float *) out.data())[i]);
    }
    CHECK(finite, "fused flash attention produced non-finite values");
}

int main(int argc, char ** argv) {
    const int dev = argc > 1 ? atoi(argv[1]) : 0;
    if (ggml_backend_vk_get_device_count() <= dev) {
        printf("test-rq-vulkan: skipped: no Vulkan device %d (lavapipe needs GGML_VK_VISIBLE_DEVICES=0)\n", dev);
        return 0;
    }
    char desc[256];
    ggml_backend_vk_get_device_description(dev, desc, sizeof(desc));
    ggml_backend_t vk = ggml_backend_vk_init(dev);
    if (!vk) {
        fprintf(stderr, "test-rq-vulkan: cannot initialise Vulkan device %d\n", dev);
        return 1;
    }
    std::mt19937 rng(20261201);
    for (ggml_type t : ISO_TYPES) {
        test_quantise(vk, t, rng);
        test_quantise_sweep(vk, t, rng);
        test_dequantise(vk, t, rng);
    }
    test_itq3_get_rows(vk, rng);
    test_fused_counts(vk, rng);
    ggml_backend_free(vk);
    printf("test-rq-vulkan (%s): %s\n", desc, n_fail ? "FAILED" : "ok");
    return n_fail ? 1 : 0;
}
