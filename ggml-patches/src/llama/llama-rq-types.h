#pragma once

// Plain data of RotaryQuant's llama hooks (llama-rq.h), kept apart so that llama-model.h and llama-graph.h can hold
// them without pulling in the KV cache.

#include "llama.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct ggml_tensor;
class  llama_kv_rq;

// the recent window a context gets when it names none (kv_window -1) and its cache can take one: 16 positions keep
// 2-6x of a 3-bit K's attention error for 0.125 bits/value at 2K (docs/NOTES.md, the recent window)
#define LLAMA_RQ_KV_WINDOW_DEFAULT 16

// the bits per cached value the default per-layer types stay within (llama-rq-layers.cpp): the long-context budget
// the needle and 32K results are measured against
#define LLAMA_RQ_KV_AUTO_BITS 3.5

// the RotaryQuant fields of llama_context_params, fixed for the life of a context
struct llama_rq_params {
    bool    iso_unfused = false;               // IsoQuant K/V dequantised to F16 before attention
    int32_t k_center    = LLAMA_K_CENTER_AUTO; // enum llama_k_center
    int64_t kv_deferred = 0;                   // deferred prefill budget in cells: 0 off, -1 the whole cache
    std::string kv_layer_types;                // per-layer K/V cache types (llama.h: kv_layer_types)
    int32_t kv_window   = -1;                  // exact recent window in positions, -1 the default (llama.h: kv_window)
};

// rotaryquant.k_center.* as loaded from the GGUF (written by rq-calibrate): per layer the offset of its
// [n_head_kv][n_embd_head_k] block in mu/lam, -1 where the layer has none; empty when the model is not calibrated
struct llama_rq_k_center_self;
struct llama_rq_k_center_data {
    std::vector<int32_t> off;
    std::vector<float>   mu;
    std::vector<float>   lam;

    // an uncalibrated model's measured statistics (llama-rq.h), shared by all contexts of the model
    std::shared_ptr<llama_rq_k_center_self> self;
};

// graph inputs of a ubatch that attends through the deferred-prefill transient, or uses the recent window; null otherwise
struct llama_rq_dfr_inputs {
    ggml_tensor * w_rows = nullptr; // I64 [n_tokens]: the transient row each token's K/V go to
    ggml_tensor * rows   = nullptr; // I32 [n]: transient rows the ubatch can see
    ggml_tensor * cells  = nullptr; // I64 [n]: their cells in the attended view

    ggml_tensor * win_w     = nullptr; // I64 [n_tokens]: the window row each token's K/V go to
    ggml_tensor * win_rows  = nullptr; // I32 [n_kv, n_stream]: each cell's window row in the attended view, -1: none
    ggml_tensor * win_until = nullptr; // I32 [n_kv, n_stream]: the last query position the row counts for
    ggml_tensor * win_qpos  = nullptr; // I32 [n_tokens/n_stream, n_stream]: the queries' positions
};

// what a context shares with the KV caches it created: their deferred-prefill counters, and the caches themselves
struct llama_rq_ctx {
    llama_rq_kv_stats                stats = {};
    std::vector<llama_kv_rq *>       caches;
};
