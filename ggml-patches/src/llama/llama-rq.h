#pragma once

// RotaryQuant in llama's KV cache (the types and kernels are in ggml-rq.h):
//  - K centring / Q-K rebalancing: with the model's rotaryquant.k_center calibration (rq-calibrate) keys are cached
//    as (k - mu)/lam and queries multiplied by lam; softmax(q.k) is unchanged (docs/k-center.md);
//  - deferred prefill: while a sequence processes its prompt, its K/V rows are also kept in an F16 transient and its
//    prompt attends to those exact rows; its first single-token step releases them (docs/deferred-prefill.md);
//  - the recent window: with an IsoQuant V cache, F16 copies (in the cache's domain) of each sequence's last kv_window
//    positions, and of the ubatch's own tokens, stand in for their packed K/V for the queries within kv_window of them.
// All are settings of a context (llama_context_params: k_center, kv_deferred, kv_window). Upstream files reach them
// through a few hook lines; llama_kv_cache and llama_batch_allocr name llama_kv_rq a friend. One unit per concern:
// llama-rq.cpp (settings, the batch split, each cache's state, graph hooks, C API), llama-rq-layers.cpp (per-layer
// cache types), llama-rq-kstats.cpp (K statistics and centring), llama-rq-deferred.cpp, llama-rq-window.cpp, llama-rq-state.cpp.

#include "llama-rq-types.h"

#include "llama-kv-cache.h"

#include "ggml-cpp.h"

#include <bitset>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct gguf_context;
struct llama_model_loader;
struct llm_graph_context;
class  llama_batch_allocr;
class  llama_io_read_i;
class  llama_io_write_i;

// the per-layer tensors of K centring: k is cached as k*k_scale + k_bias = (k - mu)/lam, q multiplied by
// q_scale = lam (expanded to the query heads); all null when not active
struct llama_rq_k_center {
    ggml_tensor * k_scale = nullptr; // [n_embd_head_k, n_head_kv]
    ggml_tensor * k_bias  = nullptr; // [n_embd_head_k, n_head_kv]
    ggml_tensor * q_scale = nullptr; // [n_embd_head_k, n_head]
};

// the K/V cache types of layer il: the context's kv_layer_types where it names the layer, else type_k/type_v (throws
// with the fix on a spec that does not parse or a type the layer's head size cannot take)
std::pair<ggml_type, ggml_type> llama_rq_layer_types(const llama_hparams & hparams, uint32_t il, ggml_type type_k, ggml_type type_v);

// sequence state files (llama_state_seq_save_file; llama-server's slots) end with a checksum of what precedes it,
// which a loader that does not know it ignores: seal after writing; check before anything is read into the cache
// (false, logged, when the sum does not match; a file without one passes, as files from other builds must)
void llama_rq_state_file_seal(const char * path);
bool llama_rq_state_file_check(const char * path);

// the context's per-layer types (llama-rq-layers.cpp) from its kv_layer_types: "model" is the allocation rq-calibrate
// --kv-bits stored in the model (rotaryquant.kv_alloc.layer_types; throws with the fix when there is none), "none" the
// plain type_k/type_v everywhere, none given the default (4-bit K on a sliding-window model's full-attention layers,
// or on the layers the K statistics' copy task ranks first, while the cache stays within LLAMA_RQ_KV_AUTO_BITS),
// anything else is taken as given
struct llama_cparams;
std::string llama_rq_kv_layer_types(const llama_model & model, const llama_context_params & params,
                                    const llama_cparams & cparams);

// architectures whose K cache is written or read outside build_attn: neither hook reaches them
bool llama_rq_arch_unhooked(llm_arch arch);

//
// K statistics (llama-rq-kstats.cpp): mu/lam of K centring from the model's calibration (rotaryquant.k_center, written
// by rq-calibrate) or, without one, measured from the model once and kept in a stats file (llama.h: k_stats_path)
//

// what a model without a calibration measured or loaded, once for all its contexts
struct llama_rq_k_center_self {
    std::mutex             mtx;
    bool                   done = false;
    std::string            id;                  // the model's content identity (names its stats file)
    std::string            source;              // where the statistics came from and what they cost, for the log
    double                 secs = 0.0;          // this start's cost (measuring or loading)
    double                 secs_measured = 0.0; // the measurement's
    uint32_t               n_tokens = 0;
    llama_rq_k_center_data data;                // off empty: none (not measured, or the pass failed)
    std::vector<float>     retrieval;           // per layer: what 3-bit K costs its retrieval (llama_rq_copy_task), -1: none
};

// at model load: reads rotaryquant.k_center.* (throws with the fix on a malformed or foreign calibration); without
// one, takes the model's content identity
void llama_rq_load_k_center(llama_model_loader & ml, const llama_hparams & hparams, llama_rq_k_center_data & out);

// a K cache of this type is centred: quantised under 6 bits/value (measured: uncalibrated 3- and 4-bit K caches break
// models whose keys carry large per-channel offsets, Qwen2.5 repeats one word with isoquant3_0 or q4_0 K; 8-bit K
// keeps their quality)
inline bool llama_rq_k_needs_center(ggml_type type_k) {
    return ggml_is_quantized(type_k) && 8.0*ggml_type_size(type_k)/ggml_blck_size(type_k) < 6.0;
}

// before a context is created (llama_init_from_model): the K statistics its caches centre with, when they need them
// and the model has no calibration (llama_rq_measure_k_stats)
void llama_rq_k_stats_for_context(llama_model & model, const llama_context_params & params);

// the model's measured or loaded statistics, null when there are none
const llama_rq_k_center_self * llama_rq_k_stats(const llama_model & model);

// split_simple (equal == false) or split_equal(n_ubatch, true, 0) that keeps the two phases apart: first the tokens
// of sequences with a single token in the batch (decoding), then the rest (prompts), so that a decode step reads the
// cache the same way whatever else was batched with it
llama_ubatch llama_rq_split_phase(llama_batch_allocr & balloc, uint32_t n_ubatch, bool equal);

class llama_kv_rq;

// The KV caches constructed on this thread while a scope is alive take its settings and join its llama_rq_ctx (one
// set of counters, the list of the caches). llama_context opens it around create_memory: upstream's memory classes
// construct llama_kv_cache from explicit argument lists, and this spares threading one more argument through each.
class llama_rq_scope {
public:
    explicit llama_rq_scope(const llama_rq_params & params);
    ~llama_rq_scope();

    static llama_rq_scope * current(); // null outside a scope

    const llama_rq_params params;
    std::shared_ptr<llama_rq_ctx> ctx = std::make_shared<llama_rq_ctx>();

private:
    llama_rq_scope * prev;
};

// RotaryQuant state of one llama_kv_cache
class llama_kv_rq {
public:
    // at the end of llama_kv_cache's constructor, with the settings of the scope it is built in
    static std::shared_ptr<llama_kv_rq> create(llama_kv_cache & kv, ggml_type type_k, ggml_type type_v);

    llama_kv_rq(llama_kv_cache & kv, const llama_rq_params & params, std::shared_ptr<llama_rq_ctx> ctx);
    ~llama_kv_rq();

    // K centring (llama-rq-kstats.cpp): the tensors of model layer il (null when off)
    const llama_rq_k_center & k_center(int32_t il) const;

    // cached rows (quantised or not) of layer il as F32 in the model's basis: attn_rot and K centring undone
    ggml_tensor * to_model_basis(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * rot, int32_t il, bool is_k) const;
    // the inverse of to_model_basis's centring step (K only)
    ggml_tensor * k_recenter(ggml_context * ctx, ggml_tensor * cur, int32_t il) const;

    // deferred prefill (llama-rq-deferred.cpp)
    bool deferred_on() const { return dfr_budget > 0; }
    void batch(const llama_batch_allocr & balloc); // before a batch is split: which sequences process prompts
    bool ubatch(const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ub); // after apply_ubatch; true: attend
                                                                                   // through the transient
    void drop_stale(); // rows whose cell was emptied or moved
    void drop_all();
    void release_seq(llama_seq_id seq_id); // seq_id's rows, as its first decode step would (llama_rq_kv_release)

    // adds this cache's K/V bytes (allocated, or what would be without no_alloc) and its own buffers' to m
    void memory(llama_rq_memory & m) const;

    // state files (llama-rq-state.cpp): after upstream's K/V data of a stream, the recent window's rows of its saved
    // cells (cr, in that order) that a query of the saved sequences can still use; a cache with an IsoQuant V writes
    // the section with the window on or off, so a state loads whatever either context's window (rows a context cannot
    // take are skipped: those keys are read packed). state_read: false, logged, on a state without the section
    void state_write(llama_io_write_i & io, const llama_kv_cache::cell_ranges_t & cr, llama_seq_id seq_id) const;
    bool state_read(llama_io_read_i & io, uint32_t strm, const llama_kv_cache::slot_info & sinfo);

    void build_input(ggml_context * ctx, llama_rq_dfr_inputs & inp) const;
    void set_input(const llama_rq_dfr_inputs & inp) const;
    // the window inputs of a graph built for another ubatch fit this one
    bool window_fits(const llama_rq_dfr_inputs & inp) const;
    bool window_active() const { return !win_w.empty(); }

    // the recent window (llama-rq-window.cpp). K-shift (build_graph_shift): the window's K rows move with their cells.
    // window_shift_input adds the graph input of each row's shift (null without a window); window_shift re-ropes layer
    // il's rows as the cache's K (build_rope_shift: un-centre, RoPE, re-centre). Setting the input moves each shifted
    // row's position along, so the row stays its cell's (without it a shifted cell lost its row: its key read packed
    // until N more tokens)
    ggml_tensor * window_shift_input(llm_graph_result * res, ggml_context * ctx);
    void window_shift(ggml_context * ctx, ggml_cgraph * gf, const llama_cparams & cparams, int32_t il, ggml_tensor * shift,
                      ggml_tensor * rot, ggml_tensor * factors, float freq_base, float freq_scale) const;
    void set_window_shift(ggml_tensor * shift);

    // writes the ubatch's k/v (as the cache gets them) into the window rows of layer il; with attend, the exact-row
    // sources of the layer's attention (k, v), null when the layer has no window or the attention will not read them
    std::pair<ggml_tensor *, ggml_tensor *> build_window(ggml_context * ctx, ggml_cgraph * gf, const llama_rq_dfr_inputs & inp,
            ggml_tensor * k_cur, ggml_tensor * v_cur, int32_t il, bool attend) const;

    // writes the ubatch's raw (uncentred, unrotated) k_raw/v_raw into the transient and replaces the views k/v of the
    // cache by F16 tensors in the model's basis with the transient rows patched in; q must then be raw too
    void build_attn(ggml_context * ctx, ggml_cgraph * gf, const llama_rq_dfr_inputs & inp,
            ggml_tensor * k_raw, ggml_tensor * v_raw, ggml_tensor *& k, ggml_tensor *& v,
            ggml_tensor * k_rot, ggml_tensor * v_rot, int32_t il, uint32_t n_kv) const;

private:
    llama_kv_cache & kv;
    const llama_rq_params params;
    std::shared_ptr<llama_rq_ctx> ctx;
    llama_rq_kv_stats & stats;

    std::vector<llama_rq_k_center> kc;  // per cache layer
    std::vector<ggml_tensor *>      k_dfr; // per cache layer: F16 [n_embd_gqa, dfr_budget + 1] (the last row takes
    std::vector<ggml_tensor *>      v_dfr; // the tokens that keep no row), null when that side is not deferred

    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> kc_ctxs_bufs;  // never cleared, not state
    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> dfr_ctxs_bufs; // allocated while rows are used
    std::vector<ggml_backend_buffer_type_t> dfr_bufts;

    uint32_t dfr_budget      = 0;
    size_t   dfr_row_bytes   = 0;           // one row over all layers, K and V
    bool     dfr_full_logged = false;
    std::vector<int32_t>   dfr_row_of_cell; // [n_stream*kv_size], -1: none
    std::vector<int64_t>   dfr_cell_of_row; // [dfr_budget], strm*kv_size + idx; -1: free
    std::vector<llama_pos> dfr_pos_of_row;  // the cell's position when written: a shifted cell loses its row
    std::vector<int32_t>   dfr_free;        // free rows, lowest last
    uint32_t               dfr_used = 0;
    std::bitset<LLAMA_MAX_SEQ> dfr_prompt;  // sequences with more than one token in the current batch

    // the current ubatch's inputs (set by ubatch())
    std::vector<int64_t> dfr_w;     // [n_tokens] transient row of each token
    std::vector<int32_t> dfr_rows;  // transient rows visible to the ubatch (none gathered when it attends in place)
    std::vector<int64_t> dfr_cells; // ... and their cells in the attended view
    bool dfr_in_place = false;      // every attended cell is its own row: the ubatch attends the transient itself

    // the recent window (kv_window): rows as in the transient, kept while a sequence may still attend within win of them
    uint32_t win        = 0; // positions, 0: off
    uint32_t win_budget = 0;
    std::vector<ggml_tensor *> k_win; // per cache layer: F16 [n_embd_gqa, win_budget + 1] (the last row: the spare)
    std::vector<ggml_tensor *> v_win;
    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> win_ctxs_bufs;
    std::vector<int32_t>   win_row_of_cell;
    std::vector<int64_t>   win_cell_of_row;
    std::vector<llama_pos> win_pos_of_row;
    std::vector<int32_t>   win_free;
    bool                   win_full_logged = false;
    uint32_t               win_ns = 1; // streams of the attended view
    // the current ubatch's window inputs (ubatch())
    std::vector<int64_t> win_w;
    std::vector<int32_t> win_rows;
    std::vector<int32_t> win_until;
    std::vector<int32_t> win_qpos;

    void init_k_center(ggml_type type_k);
    void init_deferred(ggml_type type_k, ggml_type type_v);
    void init_window(ggml_type type_v);
    // cell c (strm*kv_size + idx) still holds position pos: not emptied, not moved by a shift (a row of it is valid)
    bool cell_holds(int64_t c, llama_pos pos) const;
    // ... holds what was at pos before a pending shift (seq_add / seq_div) that the next K-shift applies
    bool cell_moved_from(int64_t c, llama_pos pos) const;
    void win_release(uint32_t row);
    // a query at or after next[s] (none, or INT_MAX there: the sequence's next position) of one of row r's sequences
    // (only: that one) can still use it; release the rows none can
    bool win_row_used(uint32_t r, const std::vector<llama_pos> * next, llama_seq_id only = -1) const;
    void win_release_unused(const std::vector<llama_pos> & next);
    bool win_section() const; // the cache writes a window section in state files
    std::pair<uint32_t, uint64_t> win_layout() const; // layers with a window, bytes of one row over them (K and V)
    void win_ubatch(const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ub);
    void release(uint32_t row);
    void add_bytes(int64_t n);
};

// one attention layer's rewrite in llm_graph_context::build_attn: K centring of q/k (and, under an eval callback, the
// named inputs attn_q_in/attn_k_in/attn_v_in and attn_q_sm, q times the softmax scale: what the K statistics and the
// retrieval ranking read); for a ubatch that attends through the deferred
// transient, q as the model computed it and K/V in the model's basis
struct llama_rq_attn {
    llama_rq_attn(const llm_graph_context & g, const llama_kv_cache_context * mctx, const llama_rq_dfr_inputs & inp,
                  ggml_tensor *& q_cur, ggml_tensor *& k_cur, ggml_tensor * v_cur, ggml_tensor * sinks, float kq_scale,
                  int il);

    // after attn_rot: the rewritten q is not read when attending through the transient
    void raw_q(ggml_tensor *& q_cur) const { if (dfr) { q_cur = q_raw; } }
    // after the cache views are taken: replaces them when attending through the transient
    void kv(ggml_tensor *& k, ggml_tensor *& v, ggml_tensor * k_rot, ggml_tensor * v_rot) const;
    // before build_attn_mha, with k_cur/v_cur as the cache gets them: the recent window's rows are written (the graph
    // must hold the writes before the attention that reads them); after it, window_attend() hands them to the
    // layer's flash attention when it reads IsoQuant V
    void window(ggml_tensor * k_cur, ggml_tensor * v_cur);
    void window_attend() const;

    bool dfr = false;

private:
    const llm_graph_context & g;
    const llama_kv_cache_context * mctx;
    const llama_rq_dfr_inputs & inp;
    ggml_tensor * q_raw;
    ggml_tensor * k_raw;
    ggml_tensor * v_raw;
    ggml_tensor * k_win = nullptr; // the window rows after this ubatch's write (window())
    ggml_tensor * v_win = nullptr;
    int il;
};

// graph inputs of the deferred transient for one cache's context (no-ops when the ubatch does not attend through it)
void llama_rq_build_input(ggml_context * ctx, const llama_kv_cache_context * mctx, llama_rq_dfr_inputs & inp);
void llama_rq_set_input(const llama_kv_cache_context * mctx, const llama_rq_dfr_inputs & inp);
// a graph that attends through the transient has its own inputs: not reused
bool llama_rq_can_reuse(const llama_kv_cache_context * mctx, const llama_rq_dfr_inputs & inp);
