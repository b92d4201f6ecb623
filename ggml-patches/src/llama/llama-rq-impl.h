#pragma once

// what the llama-rq units share and nothing outside them uses (llama-rq.h is their interface)

#include "llama-rq.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstring>
#include <map>
#include <random>
#include <vector>

struct llama_hparams;

// the small per-layer tensors of a cache (K centring, the deferred transient, the recent window) live next to each
// layer's K, one no_alloc context per buffer type (ordered by name, as the cache's own contexts are)
struct rq_buft_cmp {
    bool operator()(ggml_backend_buffer_type_t a, ggml_backend_buffer_type_t b) const {
        return strcmp(ggml_backend_buft_name(a), ggml_backend_buft_name(b)) < 0;
    }
};
using rq_buft_ctxs = std::map<ggml_backend_buffer_type_t, ggml_context_ptr, rq_buft_cmp>;

// the context of ctxs for buft, created for n_tensors on first use (throws naming what on failure)
ggml_context * llama_rq_buft_ctx(rq_buft_ctxs & ctxs, ggml_backend_buffer_type_t buft, size_t n_tensors, const char * what);

// the rows of a pool (cell_of_row: strm*kv_size + idx, -1 free) whose cells the ubatch attends to (cells [0, n_kv) of
// streams s0..s1): f(row, the cell's index in the attended view)
template <typename F>
inline void rq_rows_in_view(const std::vector<int64_t> & cell_of_row, uint32_t kv_size,
                            const llama_kv_cache::slot_info & sinfo, uint32_t n_kv, F && f) {
    for (uint32_t r = 0; r < cell_of_row.size(); ++r) {
        const int64_t c = cell_of_row[r];
        if (c < 0) {
            continue;
        }
        const uint32_t strm = c/kv_size;
        const uint32_t idx  = c % kv_size;
        if (strm >= sinfo.s0 && strm <= sinfo.s1 && idx < n_kv) {
            f(r, (int64_t) (strm - sinfo.s0)*n_kv + idx);
        }
    }
}

// strided read of an F32 [hd, n_head, n_tokens] view: f(token, head, channel, value)
template <typename F>
inline void rq_read_f32(const ggml_tensor * t, std::vector<uint8_t> & buf, F && f) {
    buf.resize(ggml_nbytes(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
        for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
            const uint8_t * row = buf.data() + i1*t->nb[1] + i2*t->nb[2];
            for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
                f(i2, i1, i0, *(const float *) (row + i0*t->nb[0]));
            }
        }
    }
}

// The copy task that ranks layers for the default per-layer types (llama-rq-retrieval.cpp): one more sequence of the K
// statistics' pass, BOS, L distinct ordinary tokens, the same L again. In the second copy an induction (retrieval) head
// attends from each token to the successor of its earlier occurrence, L - 1 positions back: beyond the recent window,
// so what the 3-bit quantiser does to K there is what it does to retrieval over long contexts. Per layer, the share of
// that attention 3-bit K gives up. L = 48: on Qwen2.5-1.5B its six layers give 2K KLD 0.0196 at 3.49 bits, where an
// offline study's at L = 1024 gave 0.0192, for ~2 s of Qwen's first start (97 tokens of forward pass)
struct llama_rq_copy_task {
    static constexpr uint32_t L = 48;

    llama_rq_copy_task(const std::vector<llama_token> & ordinary, std::mt19937 & rng, llama_token bos, uint32_t n_layer);

    // under the pass's eval callback: the tensors it reads (attn_q_sm-N, attn_k_in-N), and keeping one it asked for
    static bool wants(const ggml_tensor * t);
    void take(const ggml_tensor * t, std::vector<uint8_t> & buf);
    // per layer (n_layer): what 3-bit K loses, centred with d's mu/lam; -1 where not measured; layers split over
    // n_threads
    std::vector<float> losses(const llama_hparams & hp, const llama_rq_k_center_data & d, int32_t n_threads) const;

    std::vector<llama_token>        tokens;
    uint32_t                        off = 0; // the first copy's position (1 after BOS)
    std::vector<std::vector<float>> q, k;    // per layer [token][head][channel]: q times the softmax scale, post-RoPE K
    bool                            bad = false;
};
