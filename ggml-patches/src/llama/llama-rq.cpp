// RotaryQuant in llama's KV cache (llama-rq.h): the settings scope, the batch split by phase, each cache's state and
// the lifecycle of its rows, the graph hooks and the C API. Per-layer cache types (llama-rq-layers.cpp), K statistics
// and centring (llama-rq-kstats.cpp), deferred prefill (llama-rq-deferred.cpp), the recent window
// (llama-rq-window.cpp) and state files (llama-rq-state.cpp) are units of their own.

#include "llama-rq.h"
#include "llama-rq-impl.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-rq.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <tuple>

bool llama_rq_arch_unhooked(llm_arch arch) {
    return arch == LLM_ARCH_DEEPSEEK32 || arch == LLM_ARCH_DEEPSEEK4 || arch == LLM_ARCH_GLM_DSA ||
           arch == LLM_ARCH_HY_V4 || arch == LLM_ARCH_DFLASH || arch == LLM_ARCH_GLM5_NEXT ||
           arch == LLM_ARCH_MINIMAX_M3 || arch == LLM_ARCH_QWEN4EXP || arch == LLM_ARCH_DOTS3NOTE;
}

const char * llama_rq_unhooked_archs(void) {
    static const std::string names = [] {
        std::string s;
        for (int a = 0; a < LLM_ARCH_UNKNOWN; ++a) {
            if (llama_rq_arch_unhooked((llm_arch) a)) {
                s += s.empty() ? "" : ",";
                s += llm_arch_name((llm_arch) a);
            }
        }
        return s;
    }();
    return names.c_str();
}

//
// settings scope
//

static thread_local llama_rq_scope * rq_scope_cur = nullptr;

llama_rq_scope::llama_rq_scope(const llama_rq_params & params) : params(params), prev(rq_scope_cur) {
    rq_scope_cur = this;
}

llama_rq_scope::~llama_rq_scope() {
    rq_scope_cur = prev;
}

llama_rq_scope * llama_rq_scope::current() {
    return rq_scope_cur;
}

//
// batch split by phase
//

llama_ubatch llama_rq_split_phase(llama_batch_allocr & b, uint32_t n_ubatch, bool equal) {
    const auto is_single = [&](uint32_t i) { return b.seq_pos[b.seq_id[i][0]].size() == 1; };

    bool single = false;
    for (uint32_t i = 0; i < b.used.size() && !single; ++i) {
        single = !b.used[i] && is_single(i);
    }

    if (!equal) {
        // split_simple over this phase's tokens (split_simple itself takes a contiguous run)
        std::vector<int32_t> idxs;
        for (uint32_t i = 0; i < b.used.size() && idxs.size() < n_ubatch; ++i) {
            if (b.used[i] || is_single(i) != single) {
                continue;
            }
            idxs.push_back(i);
            b.used[i] = true;
            ++b.n_used;
        }
        return idxs.empty() ? llama_ubatch{} : b.ubatch_add(idxs, idxs.size(), false);
    }

    // split_equal skips used tokens: hide the other phase's tokens from it
    std::vector<uint32_t> hidden;
    for (uint32_t i = 0; i < b.used.size(); ++i) {
        if (!b.used[i] && is_single(i) != single) {
            b.used[i] = true;
            hidden.push_back(i);
        }
    }

    llama_ubatch res = b.split_equal(n_ubatch, true, 0);

    for (uint32_t i : hidden) {
        b.used[i] = false;
    }

    return res;
}

//
// per-cache state
//

ggml_context * llama_rq_buft_ctx(rq_buft_ctxs & ctxs, ggml_backend_buffer_type_t buft, size_t n_tensors, const char * what) {
    auto it = ctxs.find(buft);
    if (it == ctxs.end()) {
        ggml_init_params params = { n_tensors*ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx { ggml_init(params) };
        if (!ctx) {
            throw std::runtime_error(std::string("failed to create ggml context for ") + what);
        }
        it = ctxs.emplace(buft, std::move(ctx)).first;
    }
    return it->second.get();
}

std::shared_ptr<llama_kv_rq> llama_kv_rq::create(llama_kv_cache & kv, ggml_type type_k, ggml_type type_v) {
    const llama_rq_scope * scope = llama_rq_scope::current();
    auto rq = std::make_shared<llama_kv_rq>(kv, scope ? scope->params : llama_rq_params{},
                                            scope ? scope->ctx : std::make_shared<llama_rq_ctx>());
    if (!kv.other) { // a cache that views another's cells leaves both hooks to the owner
        if (!rq->params.kv_layer_types.empty()) {
            // the layers' own types (--kv-layer-types): the fewest bits per value decide (quantised < F16)
            auto bpv = [](ggml_type t) { return 8.0*ggml_type_size(t)/ggml_blck_size(t); };
            std::string mixed;
            for (size_t i = 0; i < kv.layers.size(); ++i) {
                const auto & layer = kv.layers[i];
                const ggml_type tk = layer.k->type, tv = layer.v ? layer.v->type : type_v;
                type_k = i == 0 || bpv(tk) < bpv(type_k) ? tk : type_k;
                type_v = i == 0 || bpv(tv) < bpv(type_v) ? tv : type_v;
                if (layer.v && ggml_is_quantized(tv) && kv.v_trans) {
                    throw std::runtime_error(format("kv_layer_types: layer %d has a quantised V cache (%s), which needs "
                        "flash attention: use -fa on", layer.il, ggml_type_name(tv)));
                }
                mixed += format("%s%d:%s/%s", i ? " " : "", layer.il, ggml_type_name(tk), ggml_type_name(tv));
            }
            LLAMA_LOG_INFO("%s: per-layer K/V types (%s): %s\n", __func__, rq->params.kv_layer_types.c_str(), mixed.c_str());
        }
        rq->init_k_center(type_k);
        rq->init_deferred(type_k, type_v);
        rq->init_window(type_v);
    }
    return rq;
}

llama_kv_rq::llama_kv_rq(llama_kv_cache & kv, const llama_rq_params & params, std::shared_ptr<llama_rq_ctx> ctx) :
    kv(kv), params(params), ctx(std::move(ctx)), stats(this->ctx->stats),
    kc(kv.layers.size()), k_dfr(kv.layers.size(), nullptr), v_dfr(kv.layers.size(), nullptr),
    k_win(kv.layers.size(), nullptr), v_win(kv.layers.size(), nullptr) {
    this->ctx->caches.push_back(this);
}

llama_kv_rq::~llama_kv_rq() {
    add_bytes(-(int64_t) (dfr_used*dfr_row_bytes));
    auto & c = ctx->caches;
    c.erase(std::remove(c.begin(), c.end(), this), c.end());
}

void llama_kv_rq::memory(llama_rq_memory & m) const {
    if (kv.other) {
        return; // views another cache's tensors
    }
    m.kv_k += kv.size_k_bytes();
    m.kv_v += kv.size_v_bytes();
    // the K-centring tensors and the recent window; not the deferred transient, which exists only while rows are used
    // (deferred_bytes)
    for (const auto * bufs : { &kc_ctxs_bufs, &win_ctxs_bufs }) {
        for (const auto & [c, buf] : *bufs) {
            for (ggml_tensor * t = ggml_get_first_tensor(c.get()); t; t = ggml_get_next_tensor(c.get(), t)) {
                m.kv_other += ggml_nbytes(t);
            }
        }
    }
}

bool llama_kv_rq::cell_holds(int64_t c, llama_pos pos) const {
    const auto & cells = kv.v_cells[c/kv.get_size()];
    const uint32_t idx = c % kv.get_size();
    return !cells.is_empty(idx) && cells.pos_get(idx) == pos;
}

bool llama_kv_rq::cell_moved_from(int64_t c, llama_pos pos) const {
    const auto & cells = kv.v_cells[c/kv.get_size()];
    const uint32_t idx = c % kv.get_size();
    return !cells.is_empty(idx) && cells.get_shift(idx) != 0 && cells.pos_get(idx) - cells.get_shift(idx) == pos;
}

void llama_kv_rq::drop_stale() {
    // a window row whose cell only moved (seq_add / seq_div; the K-shift re-ropes the row with the cache) stays
    const bool shiftable = kv.hparams.n_lora_kv == 0;
    for (uint32_t r = 0; r < win_budget; ++r) {
        const int64_t c = win_cell_of_row[r];
        if (c >= 0 && !cell_holds(c, win_pos_of_row[r]) && !(shiftable && cell_moved_from(c, win_pos_of_row[r]))) {
            win_release(r);
        }
    }
    if (dfr_used == 0) {
        return;
    }
    for (uint32_t r = 0; r < dfr_budget; ++r) {
        if (dfr_cell_of_row[r] >= 0 && !cell_holds(dfr_cell_of_row[r], dfr_pos_of_row[r])) {
            release(r);
        }
    }
}

void llama_kv_rq::drop_all() {
    for (uint32_t r = 0; r < win_budget; ++r) {
        if (win_cell_of_row[r] >= 0) {
            win_release(r);
        }
    }
    for (uint32_t r = 0; r < dfr_budget && dfr_used > 0; ++r) {
        if (dfr_cell_of_row[r] >= 0) {
            release(r);
        }
    }
}

//
// graph hooks
//

llama_rq_attn::llama_rq_attn(const llm_graph_context & g, const llama_kv_cache_context * mctx, const llama_rq_dfr_inputs & inp,
        ggml_tensor *& q_cur, ggml_tensor *& k_cur, ggml_tensor * v_cur, ggml_tensor * sinks, float kq_scale, int il) :
    g(g), mctx(mctx), inp(inp), q_raw(q_cur), k_raw(k_cur), v_raw(v_cur), il(il) {
    ggml_context * ctx0 = g.ctx0;

    // only with an eval callback: the extra nodes would get between RoPE and the cache write otherwise
    if (g.cparams.cb_eval) {
        const std::pair<ggml_tensor *, const char *> ins[] = { {q_cur, "attn_q_in"}, {k_cur, "attn_k_in"}, {v_cur, "attn_v_in"} };
        for (const auto & [t, name] : ins) {
            if (!t) {
                continue;
            }
            ggml_tensor * t_in = ggml_view_4d(ctx0, t, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], 0);
            g.cb(t_in, name, il);
            ggml_build_forward_expand(g.gf, t_in);
        }
        // the scale softmax applies comes as an argument, not in q (Gemma3 scales q itself and passes 1)
        ggml_tensor * q_sm = ggml_scale(ctx0, q_cur, kq_scale);
        g.cb(q_sm, "attn_q_sm", il);
        ggml_build_forward_expand(g.gf, q_sm);
    }

    dfr = !g.cparams.training && inp.w_rows != nullptr;

    // q*lam . (k - mu)/lam = q.k - q.mu, and q.mu is the same for every key of a query: softmax is unchanged. Applied
    // before any attn_rot Hadamard (orthonormal, so it keeps the identity). KV-shared layers (k_cur == nullptr) still
    // scale q, with the owning layer's lam
    const llama_rq_k_center & kc = mctx->get_rq()->k_center(il);
    if (!kc.k_scale) {
        return;
    }
    GGML_ASSERT(sinks == nullptr && "K centring with attention sinks is refused at cache creation");

    q_cur = ggml_mul(ctx0, q_cur, kc.q_scale);
    g.cb(q_cur, "attn_q_kc", il);
    if (k_cur) {
        k_cur = ggml_add(ctx0, ggml_mul(ctx0, k_cur, kc.k_scale), kc.k_bias);
        g.cb(k_cur, "attn_k_kc", il);
    }
}

void llama_rq_attn::kv(ggml_tensor *& k, ggml_tensor *& v, ggml_tensor * k_rot, ggml_tensor * v_rot) const {
    if (dfr) {
        mctx->get_rq()->build_attn(g.ctx0, g.gf, inp, k_raw, v_raw, k, v, k_rot, v_rot, il, mctx->get_n_kv());
    }
}

void llama_rq_build_input(ggml_context * ctx, const llama_kv_cache_context * mctx, llama_rq_dfr_inputs & inp) {
    // the window's state is the last applied ubatch's: a memory context no ubatch was applied to (graph reservation,
    // after a K-shift too) has rq_win false and must not take it
    if (mctx->rq_dfr || mctx->rq_win) {
        mctx->get_rq()->build_input(ctx, inp);
    }
}

void llama_rq_set_input(const llama_kv_cache_context * mctx, const llama_rq_dfr_inputs & inp) {
    if (inp.w_rows || inp.win_w) {
        mctx->get_rq()->set_input(inp);
    }
}

bool llama_rq_can_reuse(const llama_kv_cache_context * mctx, const llama_rq_dfr_inputs & inp) {
    return !inp.w_rows && !mctx->rq_dfr && mctx->get_rq()->window_fits(inp);
}

llama_rq_kv_stats llama_rq_get_kv_stats(const llama_context * ctx) {
    return ctx && ctx->rq ? ctx->rq->stats : llama_rq_kv_stats{};
}

void llama_rq_kv_release(llama_context * ctx, llama_seq_id seq_id) {
    if (ctx && ctx->rq) {
        for (llama_kv_rq * c : ctx->rq->caches) {
            c->release_seq(seq_id);
        }
    }
}

llama_rq_memory llama_rq_get_memory(const llama_context * ctx) {
    llama_rq_memory m = {};
    for (const auto & [buft, mb] : ctx->memory_breakdown()) {
        m.model   += mb.model;
        m.compute += mb.compute;
    }
    if (ctx->rq) {
        for (const llama_kv_rq * c : ctx->rq->caches) {
            c->memory(m);
        }
    }
    m.output = ctx->buf_output ? ggml_backend_buffer_get_size(ctx->buf_output.get()) : 0;
    return m;
}

const char * llama_rq_model_tensor_buft(const llama_model * model, const char * name) {
    const ggml_tensor * t = model->get_tensor(name);
    return t && t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : nullptr;
}
