// Fuzz target for the RotaryQuant C entry points: dequantise, quantise, vec_dot and the fused
// flash-attention helpers, fed random and adversarial blocks (NaN/Inf/huge fp16 norms, all-zero
// vectors). Built with AddressSanitizer + UBSan around our sources (tests/c/CMakeLists.txt), so an
// out-of-bounds read in our code aborts. Also checks the NaN policy: NaN or Inf comes out only where
// a non-finite value went in.
//
// Two drivers: libFuzzer (clang, -DRQ_LIBFUZZER, `-fsanitize=fuzzer`) for long runs, and a bounded
// standalone driver (any compiler) that generates adversarial inputs from a seed, used in CI:
//   fuzz-rq [-runs N] [-seed S]

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-rq.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
// our entry points (ggml-patches/src/cpu/rq-cpu.h), compiled into this binary with sanitizers
void ggml_rq_iso_unrotate(int n, float * acc);
}

#define FUZZ_CHECK(cond, what) do { if (!(cond)) { fprintf(stderr, "fuzz-rq: %s\n", what); abort(); } } while (0)

static uint16_t rd16(const uint8_t * p) { return (uint16_t) (p[0] | p[1] << 8); }
static bool f16_finite(uint16_t h) { return (h & 0x7c00) != 0x7c00; }

static bool all_finite(const float * x, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(x[i])) return false;
    }
    return true;
}

// blocks of `bs` bytes from the input; fp16 fields at the given offsets decide the NaN policy
static bool blocks_finite(const uint8_t * q, size_t nb, size_t bs, std::initializer_list<size_t> f16_offsets) {
    for (size_t b = 0; b < nb; ++b) {
        for (size_t o : f16_offsets) {
            if (!f16_finite(rd16(q + b*bs + o))) return false;
        }
    }
    return true;
}

static void fuzz_type(ggml_type t, const uint8_t * data, size_t size) {
    const auto * tr  = ggml_get_type_traits(t);
    const auto * trc = ggml_get_type_traits_cpu(t);
    const size_t bs = tr->type_size, qk = tr->blck_size;
    const size_t nb = size / bs;
    if (nb == 0) return;
    // exact-size copies: ASan catches any read past them
    std::vector<uint8_t> q(data, data + nb*bs);
    const size_t n = nb*qk;
    std::vector<float> x(n);
    tr->to_float(q.data(), x.data(), (int64_t) n);
    const bool iso = ggml_rq_type_is_iso(t);
    const bool fin = iso ? blocks_finite(q.data(), nb, bs, {0}) : blocks_finite(q.data(), nb, bs, {0, 2});
    if (fin) FUZZ_CHECK(all_finite(x.data(), n), "dequantised NaN/Inf from finite blocks");

    // vec_dot against a finite activation row built from the input bytes
    std::vector<float> y(n);
    for (size_t i = 0; i < n; ++i) y[i] = (float) ((int) data[(i*7) % size] - 128) / 16.0f;
    const auto * vdt = ggml_get_type_traits_cpu(trc->vec_dot_type);
    std::vector<uint8_t> yq(ggml_row_size(trc->vec_dot_type, (int64_t) n));
    vdt->from_float(y.data(), yq.data(), (int64_t) n);
    float s = 0;
    trc->vec_dot((int) n, &s, 0, q.data(), 0, yq.data(), 0, 1);
    if (fin) FUZZ_CHECK(std::isfinite(s), "vec_dot NaN/Inf from finite blocks");

    if (iso) {
        // the inverse rotation on the dequantised rows (what the fused path applies to its output)
        std::vector<float> acc(x);
        ggml_rq_iso_unrotate((int) n, acc.data());
        if (fin) FUZZ_CHECK(all_finite(acc.data(), n), "inverse rotation NaN/Inf from finite blocks");
    }

    // quantise the input reinterpreted as floats (any bit pattern, NaN/Inf/denormal included)
    std::vector<float> f(n);
    memcpy(f.data(), data, std::min(size, n*sizeof(float)));
    std::vector<uint8_t> out(nb*bs);
    ggml_quantize_chunk(t, f.data(), out.data(), 0, (int64_t) nb, (int64_t) qk, nullptr);
    if (all_finite(f.data(), n)) {
        FUZZ_CHECK(iso ? blocks_finite(out.data(), nb, bs, {0}) : blocks_finite(out.data(), nb, bs, {0, 2}),
                   "quantised NaN/Inf scale from finite input");
    }
}

// flash attention over the packed rows as both K and V (the fused path, GQA 2:1, 3 query rows)
static void fuzz_fa(ggml_type t, const uint8_t * data, size_t size) {
    const size_t bs = ggml_type_size(t), n_kv = size / bs;
    if (n_kv == 0) return;
    ggml_init_params ip = { 8u << 20, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * k = ggml_new_tensor_3d(ctx, t, 128, (int64_t) n_kv, 1);
    memcpy(k->data, data, n_kv*bs);
    ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 128, 3, 2);
    float * qd = (float *) q->data;
    for (int64_t i = 0; i < ggml_nelements(q); ++i) qd[i] = (float) ((int) data[(i*13) % size] - 128) / 32.0f;
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, k, nullptr, 0.125f, 0.0f, 0.0f);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    FUZZ_CHECK(ggml_graph_compute_with_ctx(ctx, gf, 2) == GGML_STATUS_SUCCESS, "flash attention failed");
    if (blocks_finite(data, n_kv, bs, {0})) {
        FUZZ_CHECK(all_finite((const float *) out->data, (size_t) ggml_nelements(out)), "fused attention NaN/Inf from finite blocks");
    }
    ggml_free(ctx);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    static bool init = (ggml_cpu_init(), true);
    (void) init;
    if (size < 2) return 0;
    static const ggml_type types[3] = { GGML_TYPE_ISOQUANT3_0, GGML_TYPE_ITQ3_S, GGML_TYPE_ISOQUANT4_0 };
    const ggml_type t = types[data[0] % 3];
    fuzz_type(t, data + 1, size - 1);
    if (ggml_rq_type_is_iso(t)) {
        fuzz_fa(t, data + 1, size - 1);
    }
    return 0;
}

#ifndef RQ_LIBFUZZER
// adversarial fp16 scales: NaN, +-Inf, max, min normal, denormal, zero, -0, 1
static const uint16_t k_f16[] = { 0x7e00, 0x7c00, 0xfc00, 0x7bff, 0xfbff, 0x0400, 0x0001, 0x0000, 0x8000, 0x3c00 };

int main(int argc, char ** argv) {
    long runs = 2000;
    unsigned seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-runs")) runs = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "-seed")) seed = (unsigned) atol(argv[i + 1]);
    }
    std::mt19937 rng(seed);
    for (long r = 0; r < runs; ++r) {
        const size_t bs = r % 3 == 0 ? 50 : r % 3 == 1 ? 100 : 66;  // isoquant3_0, itq3_s, isoquant4_0
        const size_t nb = 1 + rng() % 6;
        std::vector<uint8_t> buf(1 + nb*bs + rng() % 7);  // sometimes a ragged tail
        buf[0] = (uint8_t) (r % 3);
        const int mode = (int) (rng() % 4);
        for (size_t i = 1; i < buf.size(); ++i) {
            buf[i] = mode == 0 ? 0 : mode == 1 ? 0xff : (uint8_t) rng();
        }
        if (mode == 3) {  // adversarial scales in otherwise random blocks
            for (size_t b = 0; b < nb; ++b) {
                for (size_t o = 0; o < (bs == 100 ? 4u : 2u); o += 2) {
                    const uint16_t h = k_f16[rng() % (sizeof(k_f16)/sizeof(k_f16[0]))];
                    buf[1 + b*bs + o] = (uint8_t) (h & 0xff);
                    buf[1 + b*bs + o + 1] = (uint8_t) (h >> 8);
                }
            }
        }
        LLVMFuzzerTestOneInput(buf.data(), buf.size());
    }
    printf("fuzz-rq: %ld inputs, no crash, NaN policy held\n", runs);
    return 0;
}
#endif
