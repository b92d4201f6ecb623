// rq-counters: which IsoQuant attention path ran on the GPU, read from the RotaryQuant counters.
//
//   rq-counters MODEL.gguf [n_prompt=256] [n_gen=32] [cuda|vulkan|metal]
//
// Runs a prompt and n_gen single-token decode steps with an isoquant3_0 K/V cache on the GPU, once
// fused and once unfused (--isoquant-unfused), and prints the counters of the prompt and of the decode
// steps separately. Expected: fused -> iso_dequant_rows == 0 and the GPU backend's fused calls > 0
// (ggml_rq_cuda_fused_calls / ggml_rq_vk_fused_calls / ggml_rq_metal_fused_calls); unfused -> iso_dequant_rows > 0 (the K/V casts to
// F16). Exit status 1 if that does not hold.
// CUDA graphs are disabled (GGML_CUDA_DISABLE_GRAPHS=1): host-side counters only see launches, and a
// replayed graph launches nothing from the host.
//
// Build (gpu-check.sh does): g++ -O2 -std=c++17 rq-counters.cpp -I<llama>/include -I<llama>/ggml/include
//                            -L<bin> -lllama -lggml -lggml-base -ldl -Wl,-rpath,<bin>

#include "llama.h"
#include "ggml-rq.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

struct snap {
    uint64_t c[GGML_RQ_COUNTER_COUNT];
    uint64_t gpu_fused;
};

static const char * g_backend = "cuda";

// the backend's own count of fused flash-attention launches (UINT64_MAX: not a RotaryQuant build of it)
static uint64_t gpu_fused_calls() {
    using fn_t = uint64_t (*)(void);
    static fn_t fn = (fn_t) dlsym(RTLD_DEFAULT, strcmp(g_backend, "vulkan") == 0 ? "ggml_rq_vk_fused_calls"
                                              : strcmp(g_backend, "metal") == 0  ? "ggml_rq_metal_fused_calls"
                                                                                 : "ggml_rq_cuda_fused_calls");
    return fn ? fn() : UINT64_MAX;
}

static snap take() {
    snap s;
    for (int i = 0; i < GGML_RQ_COUNTER_COUNT; ++i) {
        s.c[i] = ggml_rq_counter_get((enum ggml_rq_counter) i);
    }
    s.gpu_fused = gpu_fused_calls();
    return s;
}

static void print_delta(const char * mode, const char * phase, const snap & a, const snap & b) {
    printf("%-8s %-7s", mode, phase);
    for (int i = 0; i < GGML_RQ_COUNTER_COUNT; ++i) {
        printf(" %s=%llu", ggml_rq_counter_name((enum ggml_rq_counter) i), (unsigned long long) (b.c[i] - a.c[i]));
    }
    printf(" %s_fused_calls=%llu\n", g_backend, (unsigned long long) (b.gpu_fused - a.gpu_fused));
}

// one context, prompt then decode steps; true when the decode steps took the expected path
static bool run(llama_model * model, bool unfused, int n_prompt, int n_gen) {
    llama_context_params cp = llama_context_default_params();
    cp.iso_unfused     = unfused;
    cp.n_ctx           = n_prompt + n_gen + 64;
    cp.n_batch         = n_prompt;
    cp.n_ubatch        = n_prompt;
    cp.type_k          = GGML_TYPE_ISOQUANT3_0;
    cp.type_v          = GGML_TYPE_ISOQUANT3_0;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.offload_kqv     = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "rq-counters: cannot create the context\n");
        return false;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::mt19937 rng(42);
    std::vector<llama_token> toks(n_prompt);
    for (auto & t : toks) {
        t = (llama_token) (rng() % (uint32_t) n_vocab);
    }

    const char * mode = unfused ? "unfused" : "fused";
    const snap s0 = take();
    if (llama_decode(ctx, llama_batch_get_one(toks.data(), n_prompt)) != 0) {
        fprintf(stderr, "rq-counters: prompt decode failed\n");
        return false;
    }
    const snap s1 = take();
    for (int i = 0; i < n_gen; ++i) {
        llama_token t = (llama_token) (rng() % (uint32_t) n_vocab);
        if (llama_decode(ctx, llama_batch_get_one(&t, 1)) != 0) {
            fprintf(stderr, "rq-counters: decode step %d failed\n", i);
            return false;
        }
    }
    llama_synchronize(ctx);
    const snap s2 = take();
    print_delta(mode, "prompt", s0, s1);
    print_delta(mode, "decode", s1, s2);
    llama_free(ctx);

    const uint64_t deq   = s2.c[GGML_RQ_ISO_DEQUANT_ROWS] - s1.c[GGML_RQ_ISO_DEQUANT_ROWS];
    const uint64_t fused = s2.gpu_fused - s1.gpu_fused;
    bool ok;
    if (unfused) {
        ok = deq > 0;
        printf("%-8s check: decode dequantises K/V (iso_dequant_rows=%llu > 0): %s\n", mode, (unsigned long long) deq, ok ? "PASS" : "FAIL");
    } else {
        ok = deq == 0 && fused > 0;
        printf("%-8s check: decode dequantises nothing (iso_dequant_rows=%llu) and runs the %s fused kernel "
               "(%s_fused_calls=%llu): %s\n", mode, (unsigned long long) deq, g_backend, g_backend,
               (unsigned long long) fused, ok ? "PASS" : "FAIL");
    }
    return ok;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [n_prompt] [n_gen] [cuda|vulkan|metal]\n", argv[0]);
        return 2;
    }
    setenv("GGML_CUDA_DISABLE_GRAPHS", "1", 1);
    const int n_prompt = argc > 2 ? atoi(argv[2]) : 256;
    const int n_gen    = argc > 3 ? atoi(argv[3]) : 32;
    g_backend          = argc > 4 ? argv[4] : "cuda";

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 999;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "rq-counters: cannot load %s\n", argv[1]);
        return 1;
    }
    if (gpu_fused_calls() == UINT64_MAX) {
        fprintf(stderr, "rq-counters: no fused-call counter: not a RotaryQuant %s build\n", g_backend);
        return 1;
    }
    const bool ok_f = run(model, false, n_prompt, n_gen);
    const bool ok_u = run(model, true,  n_prompt, n_gen);
    llama_model_free(model);
    llama_backend_free();
    printf("rq-counters: %s\n", ok_f && ok_u ? "PASS" : "FAIL");
    return ok_f && ok_u ? 0 : 1;
}
