#pragma once

// what the llama-rq units share and nothing outside them uses (llama-rq.h is their interface)

#include "llama-rq.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstring>
#include <map>
#include <vector>

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
