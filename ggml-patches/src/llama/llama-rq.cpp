// RotaryQuant in llama's KV cache (llama-rq.h): the settings scope, per-layer cache types, the batch split by phase,
// each cache's state and the lifecycle of its rows, the graph hooks and the C API. K statistics and centring
// (llama-rq-kstats.cpp), deferred prefill (llama-rq-deferred.cpp), the recent window (llama-rq-window.cpp) and state
// files (llama-rq-state.cpp) are units of their own.

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
// per-layer cache types
//

static ggml_type rq_kv_type_from_name(const std::string & name) {
    static const ggml_type plain[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                       GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1 };
    for (ggml_type t : plain) {
        if (name == ggml_type_name(t)) {
            return t;
        }
    }
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        if (ggml_rq_type_is_iso((ggml_type) t) && name == ggml_type_name((ggml_type) t)) {
            return (ggml_type) t;
        }
    }
    throw std::runtime_error("kv_layer_types: unknown cache type '" + name + "' (f16, q8_0, q4_0, isoquant3_0, ...)");
}

// a type the layer's heads can take; the 128-wide IsoQuant types resolve to their 64-wide siblings on 64-wide heads
static ggml_type rq_kv_type_for_head(ggml_type t, uint32_t head, uint32_t il, const char * kv) {
    if (ggml_rq_type_is_iso(t) && head == 64 && ggml_rq_iso_qk(t) == 128) {
        return ggml_rq_iso_type(ggml_rq_iso_bits(t), 64);
    }
    if (head % ggml_blck_size(t) != 0 || (ggml_rq_type_is_iso(t) && ggml_rq_iso_qk(t) == 64 && head != 64)) {
        throw std::runtime_error(format("kv_layer_types: layer %u has %s head size %u, which %s cannot take; use "
            "another type for it, e.g. %s", il, kv, head, ggml_type_name(t), head % 32 == 0 ? "q8_0" : "f16"));
    }
    return t;
}

std::pair<ggml_type, ggml_type> llama_rq_layer_types(const llama_hparams & hp, uint32_t il, ggml_type type_k, ggml_type type_v) {
    const llama_rq_scope * scope = llama_rq_scope::current();
    const std::string spec = scope ? scope->params.kv_layer_types : "";
    std::pair<ggml_type, ggml_type> res { type_k, type_v };
    bool named = false;
    size_t pos = 0;
    while (pos < spec.size()) {
        size_t end = spec.find(',', pos);
        end = end == std::string::npos ? spec.size() : end;
        const std::string item = spec.substr(pos, end - pos);
        pos = end + 1;
        const size_t eq = item.find('=');
        if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
            throw std::runtime_error("kv_layer_types: '" + item + "' is not LAYERS=K[/V] (e.g. full=q8_0/isoquant3_0)");
        }
        const std::string sel = item.substr(0, eq), types = item.substr(eq + 1);
        bool hit;
        if (sel == "*") {
            hit = true;
        } else if (sel == "swa" || sel == "full") {
            hit = hp.is_swa(il) == (sel == "swa");
        } else {
            char * e1 = nullptr;
            const long a = strtol(sel.c_str(), &e1, 10);
            long b = a;
            if (*e1 == '-') {
                char * e2 = nullptr;
                b = strtol(e1 + 1, &e2, 10);
                e1 = e2;
            }
            if (*e1 != '\0' || e1 == sel.c_str() || a < 0 || b < a || b >= (long) hp.n_layer()) {
                throw std::runtime_error(format("kv_layer_types: '%s' is not a layer, a range N-M within 0-%u, swa, "
                    "full or *", sel.c_str(), hp.n_layer() - 1));
            }
            hit = (long) il >= a && (long) il <= b;
        }
        if (hit) {
            const size_t sl = types.find('/');
            res.first  = rq_kv_type_from_name(types.substr(0, sl));
            res.second = sl == std::string::npos ? res.first : rq_kv_type_from_name(types.substr(sl + 1));
            named = true;
        }
    }
    if (named) {
        res.first  = rq_kv_type_for_head(res.first,  hp.n_embd_head_k(il), il, "K");
        res.second = rq_kv_type_for_head(res.second, hp.n_embd_head_v(il), il, "V");
    }
    return res;
}

std::string llama_rq_kv_layer_types(const llama_model & model, const char * spec) {
    if (spec == nullptr || strcmp(spec, "model") != 0) {
        return spec ? spec : "";
    }
    const auto it = model.gguf_kv.find("rotaryquant.kv_alloc.layer_types");
    if (it == model.gguf_kv.end() || it->second.empty()) {
        throw std::runtime_error("kv_layer_types = model: this model stores no per-layer K/V types; run "
            "rq-calibrate --kv-bits 3.5 on it, or give the types (e.g. full=q8_0/isoquant3_0)");
    }
    const auto bits = model.gguf_kv.find("rotaryquant.kv_alloc.bits");
    LLAMA_LOG_WARN("%s: per-layer K/V types from the model (rq-calibrate --kv-bits, %s bits/value): %s\n", __func__,
                   bits == model.gguf_kv.end() ? "?" : bits->second.c_str(), it->second.c_str());
    return it->second;
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
        ggml_tensor *& q_cur, ggml_tensor *& k_cur, ggml_tensor * v_cur, ggml_tensor * sinks, int il) :
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
