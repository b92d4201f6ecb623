#include "llama-rq.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-rq.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
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

// the small per-layer tensors live next to each layer's K, one no_alloc context per buffer type (ordered by name, as
// the cache's own contexts are)
struct rq_buft_cmp {
    bool operator()(ggml_backend_buffer_type_t a, ggml_backend_buffer_type_t b) const {
        return strcmp(ggml_backend_buft_name(a), ggml_backend_buft_name(b)) < 0;
    }
};
using rq_buft_ctxs = std::map<ggml_backend_buffer_type_t, ggml_context_ptr, rq_buft_cmp>;

static ggml_context * rq_ctx_for(rq_buft_ctxs & ctxs, ggml_backend_buffer_type_t buft, size_t n_tensors, const char * what) {
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

const llama_rq_k_center & llama_kv_rq::k_center(int32_t il) const {
    return kc[kv.map_layer_ids.at(il)];
}

void llama_kv_rq::init_k_center(ggml_type type_k) {
    const llama_model   & model   = kv.model;
    const llama_hparams & hparams = kv.hparams;

    const bool   quantized = ggml_is_quantized(type_k);
    const double bpv       = 8.0*ggml_type_size(type_k)/ggml_blck_size(type_k);
    const bool   needs     = llama_rq_k_needs_center(type_k);

    // measured before the context was created (llama_rq_k_stats_for_context)
    const llama_rq_k_center_self * self = model.rq_k_center.off.empty() && params.k_center != LLAMA_K_CENTER_OFF && needs
                                          ? llama_rq_k_stats(model) : nullptr;
    const auto & cal = self ? self->data : model.rq_k_center;
    if (cal.off.empty()) {
        if (needs && params.k_center == LLAMA_K_CENTER_OFF) {
            LLAMA_LOG_WARN("%s: K centring = off (--no-k-center, k_center = off): a %s K cache (%.2f bits/value) loses "
                "much of the model's quality without it on many models\n", __func__, ggml_type_name(type_k), bpv);
        } else if (needs && !hparams.no_alloc) {
            LLAMA_LOG_WARN("%s: K centring = off: the model has no rotaryquant.k_center calibration and no K statistics "
                "were measured (the measurement failed, or the context was not created by llama_init_from_model); a %s K "
                "cache (%.2f bits/value) loses much of the model's quality without it on many models: run rq-calibrate "
                "on the model file once, or use -ctk q8_0\n", __func__, ggml_type_name(type_k), bpv);
        } else if (quantized) {
            LLAMA_LOG_INFO("%s: K centring = off (the model has no rotaryquant.k_center calibration; rq-calibrate adds it)\n", __func__);
        }
        return;
    }
    if (params.k_center == LLAMA_K_CENTER_OFF) {
        LLAMA_LOG_INFO("%s: K centring = off (--no-k-center, k_center = off)\n", __func__);
        return;
    }
    if (!quantized && params.k_center != LLAMA_K_CENTER_FORCE) {
        LLAMA_LOG_INFO("%s: K centring = off (the K cache is %s, not quantised)\n", __func__, ggml_type_name(type_k));
        return;
    }

    // the rewrite is exact only where the logits reach softmax as q.k plus a per-query constant and where build_attn
    // writes and reads the cache
    const char * why = nullptr;
    if (hparams.is_mla()) {
        why = "K doubles as V (MLA)";
    } else if (hparams.attn_soft_cap || model.arch == LLM_ARCH_GROK) {
        why = "attention logits are soft-capped";
    } else if (llama_rq_arch_unhooked(model.arch)) {
        why = "this architecture writes its K cache outside build_attn";
    } else {
        for (const auto & layer : kv.layers) {
            if (model.layers[layer.il].attn_sinks) {
                why = "attention sinks are not shift-invariant";
                break;
            }
        }
    }
    if (why) {
        LLAMA_LOG_WARN("%s: K centring = off: the model is calibrated, but %s; the calibration is ignored\n", __func__, why);
        return;
    }

    rq_buft_ctxs ctxs;
    int n_cal = 0;
    for (size_t i = 0; i < kv.layers.size(); ++i) {
        const auto & layer = kv.layers[i];
        const uint32_t il = layer.il;
        if (cal.off[il] < 0) {
            continue;
        }
        ggml_context * ctx = rq_ctx_for(ctxs, ggml_backend_buffer_get_type(layer.k->buffer), 3*kv.layers.size(), "K centring");
        const int64_t hd = hparams.n_embd_head_k(il);
        kc[i].k_scale = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, hd, hparams.n_head_kv(il));
        kc[i].k_bias  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, hd, hparams.n_head_kv(il));
        kc[i].q_scale = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, hd, hparams.n_head(il));
        ggml_format_name(kc[i].k_scale, "k_center_scale_l%d", il);
        ggml_format_name(kc[i].k_bias,  "k_center_bias_l%d",  il);
        ggml_format_name(kc[i].q_scale, "k_center_q_l%d",     il);
        n_cal++;
    }
    for (auto & [buft, ctx] : ctxs) {
        ggml_backend_buffer_t buf = hparams.no_alloc ? ggml_backend_buft_alloc_buffer(buft, 0)
                                                     : ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (!buf) {
            throw std::runtime_error("failed to allocate buffer for K centring");
        }
        if (hparams.no_alloc) {
            for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t; t = ggml_get_next_tensor(ctx.get(), t)) {
                t->buffer = buf;
            }
        }
        kc_ctxs_bufs.emplace_back(std::move(ctx), buf);
    }
    if (!hparams.no_alloc) {
        for (size_t i = 0; i < kv.layers.size(); ++i) {
            if (!kc[i].k_scale) {
                continue;
            }
            const uint32_t il  = kv.layers[i].il;
            const int64_t  hd  = hparams.n_embd_head_k(il);
            const int64_t  nkv = hparams.n_head_kv(il);
            const int64_t  nq  = hparams.n_head(il);
            const float *  mu  = cal.mu.data()  + cal.off[il];
            const float *  lam = cal.lam.data() + cal.off[il];
            std::vector<float> a(hd*nkv), b(hd*nkv), q(hd*nq);
            for (int64_t j = 0; j < hd*nkv; ++j) {
                a[j] = 1.0f/lam[j];
                b[j] = -mu[j]/lam[j];
            }
            // query head h reads KV head h/(nq/nkv) (GQA); ggml_mul would broadcast modulo n_head_kv
            for (int64_t h = 0; h < nq; ++h) {
                memcpy(q.data() + h*hd, lam + (h/(nq/nkv))*hd, hd*sizeof(float));
            }
            ggml_backend_tensor_set(kc[i].k_scale, a.data(), 0, ggml_nbytes(kc[i].k_scale));
            ggml_backend_tensor_set(kc[i].k_bias,  b.data(), 0, ggml_nbytes(kc[i].k_bias));
            ggml_backend_tensor_set(kc[i].q_scale, q.data(), 0, ggml_nbytes(kc[i].q_scale));
        }
    }
    if (self) {
        LLAMA_LOG_INFO("%s: K centring = on, self-calibrated (%d of %d layers; K statistics %s)\n", __func__, n_cal,
            (int) kv.layers.size(), self->source.c_str());
    } else {
        LLAMA_LOG_INFO("%s: K centring = on (rotaryquant.k_center, %d of %d layers; --no-k-center turns it off)\n",
                __func__, n_cal, (int) kv.layers.size());
    }
}

ggml_tensor * llama_kv_rq::to_model_basis(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * rot, int32_t il, bool is_k) const {
    ggml_tensor * x = ggml_cast(ctx, cur, GGML_TYPE_F32);
    x = llama_mul_mat_hadamard(ctx, x, rot); // H = H^-1 (null: no rotation)
    const llama_rq_k_center & c = k_center(il);
    if (is_k && c.k_scale) {
        x = ggml_div(ctx, ggml_sub(ctx, x, c.k_bias), c.k_scale); // k = stored*lam + mu
    }
    return x;
}

ggml_tensor * llama_kv_rq::k_recenter(ggml_context * ctx, ggml_tensor * cur, int32_t il) const {
    const llama_rq_k_center & c = k_center(il);
    return c.k_scale ? ggml_add(ctx, ggml_mul(ctx, cur, c.k_scale), c.k_bias) : cur;
}

//
// deferred prefill
//

void llama_kv_rq::add_bytes(int64_t n) {
    if (n == 0) {
        return;
    }
    stats.deferred_bytes = (uint64_t) ((int64_t) stats.deferred_bytes + n);
    stats.deferred_peak_bytes = std::max(stats.deferred_peak_bytes, stats.deferred_bytes);
}

void llama_kv_rq::init_deferred(ggml_type type_k, ggml_type type_v) {
    const llama_hparams & hparams = kv.hparams;
    const int64_t req = params.kv_deferred;
    if (req == 0 || hparams.no_alloc) {
        return;
    }
    bool any_kc = false;
    for (const auto & c : kc) {
        any_kc |= c.k_scale != nullptr;
    }
    const bool dk = ggml_is_quantized(type_k) || any_kc;
    const bool dv = ggml_is_quantized(type_v);
    const char * why = nullptr;
    if (!dk && !dv) {
        why = "the cache is not quantised: prompts already attend to exact K/V";
    } else if (hparams.is_mla()) {
        why = "K doubles as V (MLA)";
    } else if (llama_rq_arch_unhooked(kv.model.arch)) {
        why = "this architecture writes its K cache outside build_attn";
    } else if (dv && kv.v_trans) {
        why = "a quantised V cache needs flash attention";
    } else if (std::any_of(kv.layers.begin(), kv.layers.end(), [](const auto & l) {
                   return l.k->buffer && !ggml_backend_buffer_is_host(l.k->buffer); })) {
        // on purpose: its prompt graphs crash inside Mesa's lavapipe (q8_0 as isoquant3_0) and never ran on CUDA
        why = "the KV cache is on a GPU device, where deferred prefill is not supported yet (docs/deferred-prefill.md)";
    }
    if (why) {
        if (strstr(why, "GPU")) {
            LLAMA_LOG_WARN("%s: deferred prefill = off (%s)\n", __func__, why);
        } else {
            LLAMA_LOG_INFO("%s: deferred prefill = off (%s)\n", __func__, why);
        }
        return;
    }

    const uint32_t n_cells = kv.get_size()*kv.n_stream;
    dfr_budget = req < 0 ? n_cells : (uint32_t) std::min<int64_t>(req, n_cells);

    rq_buft_ctxs ctxs;
    for (size_t i = 0; i < kv.layers.size(); ++i) {
        const auto & layer = kv.layers[i];
        ggml_context * ctx = rq_ctx_for(ctxs, ggml_backend_buffer_get_type(layer.k->buffer), 2*kv.layers.size(), "deferred prefill");
        if (dk) {
            k_dfr[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.k->ne[0], dfr_budget + 1);
            ggml_format_name(k_dfr[i], "cache_dfr_k_l%d", layer.il);
            dfr_row_bytes += ggml_row_size(GGML_TYPE_F16, layer.k->ne[0]);
        }
        if (dv) {
            v_dfr[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.v->ne[0], dfr_budget + 1);
            ggml_format_name(v_dfr[i], "cache_dfr_v_l%d", layer.il);
            dfr_row_bytes += ggml_row_size(GGML_TYPE_F16, layer.v->ne[0]);
        }
    }
    for (auto & [buft, ctx] : ctxs) {
        dfr_ctxs_bufs.emplace_back(std::move(ctx), nullptr);
        dfr_bufts.push_back(buft);
    }

    dfr_row_of_cell.assign(n_cells, -1);
    dfr_cell_of_row.assign(dfr_budget, -1);
    dfr_pos_of_row.assign(dfr_budget, -1);
    dfr_free.resize(dfr_budget);
    for (uint32_t r = 0; r < dfr_budget; ++r) {
        dfr_free[r] = dfr_budget - 1 - r;
    }

    LLAMA_LOG_INFO("%s: deferred prefill = on (%s%s%s in F16 for up to %u prompt cells: %.2f MiB transient, "
            "taken while prompts are processed and given back when their sequences decode)\n", __func__,
            dk ? "K" : "", dk && dv ? " and " : "", dv ? "V" : "", dfr_budget, dfr_budget*dfr_row_bytes/1024.0/1024.0);
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

// the rows of a pool (cell_of_row: strm*kv_size + idx, -1 free) whose cells the ubatch attends to (cells [0, n_kv) of
// streams s0..s1): f(row, the cell's index in the attended view)
template <typename F>
static void rq_rows_in_view(const std::vector<int64_t> & cell_of_row, uint32_t kv_size,
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

void llama_kv_rq::init_window(ggml_type type_v) {
    const llama_hparams & hparams = kv.hparams;
    const bool dflt = params.kv_window < 0; // not asked for: on where it can be, quietly off elsewhere
    if (params.kv_window == 0) {
        return;
    }
    const char * why = nullptr;
    if (!ggml_rq_type_is_iso(type_v)) {
        why = "the V cache is not IsoQuant: only the fused IsoQuant attention reads the window";
    } else if (params.iso_unfused) {
        why = "the unfused path attends to dequantised K/V";
    } else if (hparams.is_mla() || llama_rq_arch_unhooked(kv.model.arch)) {
        why = "this architecture's attention is not hooked";
    } else if (std::any_of(kv.layers.begin(), kv.layers.end(), [](const auto & l) {
                   return l.k->buffer && !ggml_backend_buffer_is_host(l.k->buffer); })) {
        why = "the KV cache is on a GPU device, whose kernels do not read the window yet";
    }
    if (why) {
        if (dflt && !ggml_rq_type_is_iso(type_v)) {
            return; // nothing to say about a cache the window is not for
        }
        if (dflt) {
            LLAMA_LOG_INFO("%s: recent window = off (%s)\n", __func__, why);
        } else {
            LLAMA_LOG_WARN("%s: recent window = off (%s)\n", __func__, why);
        }
        return;
    }

    const uint32_t w = dflt ? LLAMA_RQ_KV_WINDOW_DEFAULT : (uint32_t) params.kv_window;
    // a ubatch reads its own tokens' rows from the graph (build_window); the pool keeps, per sequence, the last w - 1
    // positions before the ubatch and the last w - 1 of the ubatch (the first are released at the next ubatch)
    const uint32_t budget = 2*w*kv.n_seq_max;

    rq_buft_ctxs ctxs;
    size_t row_bytes = 0;
    for (size_t i = 0; i < kv.layers.size(); ++i) {
        const auto & layer = kv.layers[i];
        if (!layer.v || !ggml_rq_type_is_iso(layer.v->type)) {
            continue; // --kv-layer-types: this layer's V is not IsoQuant
        }
        ggml_context * ctx = rq_ctx_for(ctxs, ggml_backend_buffer_get_type(layer.k->buffer), 2*kv.layers.size(), "the recent window");
        k_win[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.k->ne[0], budget + 1);
        v_win[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.v->ne[0], budget + 1);
        ggml_format_name(k_win[i], "cache_win_k_l%d", layer.il);
        ggml_format_name(v_win[i], "cache_win_v_l%d", layer.il);
        row_bytes += ggml_row_size(GGML_TYPE_F16, layer.k->ne[0]) + ggml_row_size(GGML_TYPE_F16, layer.v->ne[0]);
    }
    for (auto & [buft, ctx] : ctxs) {
        // no_alloc (memory planning): the tensors are counted, nothing is allocated and the window stays off
        ggml_backend_buffer_ptr buf { hparams.no_alloc ? ggml_backend_buft_alloc_buffer(buft, 0)
                                                          : ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft) };
        if (!buf) {
            throw std::runtime_error("failed to allocate the recent window");
        }
        for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); hparams.no_alloc && t; t = ggml_get_next_tensor(ctx.get(), t)) {
            t->buffer = buf.get();
        }
        if (!hparams.no_alloc) {
            ggml_backend_buffer_clear(buf.get(), 0);
        }
        win_ctxs_bufs.emplace_back(std::move(ctx), std::move(buf));
    }
    if (hparams.no_alloc) {
        std::fill(k_win.begin(), k_win.end(), nullptr);
        std::fill(v_win.begin(), v_win.end(), nullptr);
        return;
    }
    win        = w;
    win_budget = budget;

    win_row_of_cell.assign((size_t) kv.get_size()*kv.n_stream, -1);
    win_cell_of_row.assign(win_budget, -1);
    win_pos_of_row.assign(win_budget, -1);
    win_free.resize(win_budget);
    for (uint32_t r = 0; r < win_budget; ++r) {
        win_free[r] = win_budget - 1 - r;
    }
    LLAMA_LOG_INFO("%s: recent window = %u positions%s (K and V in F16 for the last %u positions of each of %u sequences: "
            "%u rows, %.2f MiB)\n", __func__, win, dflt ? ", the default (--kv-window 0: none)" : "",
            win, kv.n_seq_max, win_budget, (win_budget + 1)*row_bytes/1024.0/1024.0);
}

void llama_kv_rq::win_release(uint32_t row) {
    const int64_t c = win_cell_of_row[row];
    GGML_ASSERT(c >= 0);
    win_row_of_cell[c]   = -1;
    win_cell_of_row[row] = -1;
    win_free.push_back(row);
}

void llama_kv_rq::win_ubatch(const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ub) {
    win_w.clear();
    win_rows.clear();
    win_until.clear();
    win_qpos.clear();
    if (win == 0) {
        return;
    }
    const uint32_t kv_size = kv.get_size();
    const uint32_t n_seq   = kv.n_seq_max;

    // the first position each sequence of the ubatch queries at
    std::vector<llama_pos> first(n_seq, std::numeric_limits<llama_pos>::max());
    for (uint32_t i = 0; i < ub.n_tokens; ++i) {
        for (int32_t j = 0; j < ub.n_seq_id[i]; ++j) {
            first[ub.seq_id[i][j]] = std::min(first[ub.seq_id[i][j]], ub.pos[i]);
        }
    }
    // rows of the cells this ubatch overwrites, of cells emptied or moved, and rows no query can use any more (every
    // sequence of the cell has moved past the window: its next query position is beyond until = pos + win - 1)
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const int64_t c = (int64_t) sinfo.strm[s]*kv_size + sinfo.idxs[s][ii];
            if (win_row_of_cell[c] >= 0) {
                win_release(win_row_of_cell[c]);
            }
        }
    }
    for (uint32_t r = 0; r < win_budget; ++r) {
        const int64_t c = win_cell_of_row[r];
        if (c < 0) {
            continue;
        }
        const auto & cells = kv.v_cells[c/kv_size];
        const uint32_t idx = c % kv_size;
        bool keep = cell_holds(c, win_pos_of_row[r]);
        if (keep) {
            keep = false;
            for (llama_seq_id s = 0; s < (llama_seq_id) n_seq && !keep; ++s) {
                if (cells.seq_has(idx, s)) {
                    const llama_pos next = first[s] != std::numeric_limits<llama_pos>::max() ? first[s] : cells.seq_pos_max(s) + 1;
                    keep = win_pos_of_row[r] + (llama_pos) win > next;
                }
            }
        }
        if (!keep) {
            win_release(r);
        }
    }

    // the ubatch's own queries read its tokens' rows from the graph; a pool row for each token that a later query of
    // one of its sequences can still use (within win - 1 positions of the sequence's last one in this ubatch)
    std::vector<llama_pos> last(n_seq, std::numeric_limits<llama_pos>::min());
    for (uint32_t i = 0; i < ub.n_tokens; ++i) {
        for (int32_t j = 0; j < ub.n_seq_id[i]; ++j) {
            last[ub.seq_id[i][j]] = std::max(last[ub.seq_id[i][j]], ub.pos[i]);
        }
    }
    win_w.assign(ub.n_tokens, win_budget); // the spare row
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const uint32_t i = s*sinfo.size() + ii;
            const int64_t  c = (int64_t) sinfo.strm[s]*kv_size + sinfo.idxs[s][ii];
            bool later = false;
            for (int32_t j = 0; j < ub.n_seq_id[i] && !later; ++j) {
                later = ub.pos[i] + (llama_pos) win > last[ub.seq_id[i][j]] + 1;
            }
            if (!later) {
                continue;
            }
            if (win_free.empty()) {
                if (!win_full_logged) {
                    LLAMA_LOG_WARN("%s: recent window: no free row (%u rows); some keys are read packed\n", __func__, win_budget);
                    win_full_logged = true;
                }
                continue;
            }
            const int32_t r = win_free.back();
            win_free.pop_back();
            win_row_of_cell[c] = r;
            win_cell_of_row[r] = c;
            win_pos_of_row[r]  = ub.pos[i];
            win_w[i] = r;
        }
    }

    // the attended view: cells [0, n_kv) of streams s0..s1
    const uint32_t n_kv = kv.get_n_kv(sinfo);
    win_ns = sinfo.s1 - sinfo.s0 + 1;
    GGML_ASSERT(ub.n_tokens % win_ns == 0);
    win_rows.assign((size_t) n_kv*win_ns, -1);
    win_until.assign((size_t) n_kv*win_ns, std::numeric_limits<int32_t>::min());
    rq_rows_in_view(win_cell_of_row, kv_size, sinfo, n_kv, [&](uint32_t r, int64_t j) {
        win_rows[j]  = (int32_t) r;
        win_until[j] = win_pos_of_row[r] + (int32_t) win - 1;
    });
    // the ubatch's cells: their rows in the graph, after the pool's win_budget + 1 (build_window)
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const uint32_t i = s*sinfo.size() + ii, idx = sinfo.idxs[s][ii];
            if (idx < n_kv) {
                const int64_t j = (int64_t) (sinfo.strm[s] - sinfo.s0)*n_kv + idx;
                win_rows[j]  = (int32_t) (win_budget + 1 + i);
                win_until[j] = ub.pos[i] + (int32_t) win - 1;
            }
        }
    }
    win_qpos.assign(ub.pos, ub.pos + ub.n_tokens);
}

void llama_kv_rq::release(uint32_t row) {
    const int64_t c = dfr_cell_of_row[row];
    GGML_ASSERT(c >= 0);
    dfr_row_of_cell[c]   = -1;
    dfr_cell_of_row[row] = -1;
    dfr_free.push_back(row);
    dfr_used--;
    add_bytes(-(int64_t) dfr_row_bytes);
    if (dfr_used == 0) {
        // give the memory back: on CPU only the touched rows were ever resident
        for (auto & [ctx, buf] : dfr_ctxs_bufs) {
            buf.reset();
            for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t; t = ggml_get_next_tensor(ctx.get(), t)) {
                t->data   = nullptr;
                t->buffer = nullptr;
            }
        }
        std::sort(dfr_free.begin(), dfr_free.end(), std::greater<int32_t>());
    }
}

void llama_kv_rq::release_seq(llama_seq_id seq_id) {
    if (dfr_used == 0 || seq_id < 0 || seq_id >= (llama_seq_id) kv.seq_to_stream.size()) {
        return;
    }
    const uint32_t kv_size = kv.get_size();
    const uint32_t strm    = kv.seq_to_stream[seq_id];
    uint64_t n_rel = 0;
    for (uint32_t r = 0; r < dfr_budget; ++r) {
        const int64_t c = dfr_cell_of_row[r];
        if (c >= 0 && c/kv_size == strm && kv.v_cells[strm].seq_has(c % kv_size, seq_id)) {
            release(r);
            n_rel++;
        }
    }
    if (n_rel > 0) {
        stats.deferred_cells += n_rel;
        stats.deferred_conversions += 1;
    }
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

static constexpr uint32_t RQ_STATE_WIN_MAGIC = 0x31575152u; // "RQW1"

bool llama_kv_rq::win_section() const {
    return std::any_of(kv.layers.begin(), kv.layers.end(), [](const auto & l) { return l.v && ggml_rq_type_is_iso(l.v->type); });
}

std::pair<uint32_t, uint64_t> llama_kv_rq::win_layout() const {
    uint32_t n_layer = 0;
    uint64_t row_bytes = 0;
    for (size_t i = 0; i < k_win.size(); ++i) {
        if (k_win[i]) {
            n_layer++;
            row_bytes += k_win[i]->nb[1] + v_win[i]->nb[1];
        }
    }
    return { n_layer, row_bytes };
}

void llama_kv_rq::state_write(llama_io_write_i & io, const llama_kv_cache::cell_ranges_t & cr, llama_seq_id seq_id) const {
    if (!win_section()) {
        return;
    }
    const auto & cells = kv.v_cells[cr.strm];
    std::vector<uint32_t> ords; // the rows' cells, as their index among the saved cells
    std::vector<int32_t>  rows;
    uint32_t ord = 0;
    for (const auto & [i0, i1] : cr.data) {
        for (uint32_t i = i0; i < i1; ++i, ++ord) {
            const int64_t c = (int64_t) cr.strm*kv.get_size() + i;
            const int32_t r = win > 0 ? win_row_of_cell[c] : -1;
            if (r < 0 || !cell_holds(c, win_pos_of_row[r])) {
                continue;
            }
            bool used = false;
            for (llama_seq_id s = 0; s < (llama_seq_id) kv.n_seq_max && !used; ++s) {
                used = (seq_id == -1 || s == seq_id) && cells.seq_has(i, s) &&
                       win_pos_of_row[r] + (llama_pos) win > cells.seq_pos_max(s) + 1;
            }
            if (used) {
                ords.push_back(ord);
                rows.push_back(r);
            }
        }
    }
    const auto [n_layer, row_bytes] = win_layout();
    const uint32_t n_rows = rows.size();
    io.write(&RQ_STATE_WIN_MAGIC, sizeof(RQ_STATE_WIN_MAGIC));
    io.write(&n_layer,   sizeof(n_layer));
    io.write(&row_bytes, sizeof(row_bytes));
    io.write(&n_rows,    sizeof(n_rows));
    if (n_rows > 0) {
        io.write(ords.data(), ords.size()*sizeof(uint32_t));
    }
    for (size_t i = 0; i < k_win.size(); ++i) {
        for (ggml_tensor * t : { k_win[i], v_win[i] }) {
            for (int32_t r = 0; t && r < (int32_t) n_rows; ++r) {
                io.write_tensor(t, rows[r]*t->nb[1], t->nb[1]);
            }
        }
    }
}

bool llama_kv_rq::state_read(llama_io_read_i & io, uint32_t strm, const llama_kv_cache::slot_info & sinfo) {
    if (!win_section()) {
        return true;
    }
    uint32_t magic = 0, n_layer = 0, n_rows = 0;
    uint64_t row_bytes = 0;
    io.read(&magic, sizeof(magic));
    if (magic != RQ_STATE_WIN_MAGIC) {
        LLAMA_LOG_ERROR("%s: the state has no RotaryQuant window section after its IsoQuant K/V data (saved by an older "
                "build or with other cache types): save it again with this build and the same -ctk/-ctv\n", __func__);
        return false;
    }
    io.read(&n_layer,   sizeof(n_layer));
    io.read(&row_bytes, sizeof(row_bytes));
    io.read(&n_rows,    sizeof(n_rows));
    std::vector<uint32_t> ords(n_rows);
    if (n_rows > 0) {
        io.read(ords.data(), ords.size()*sizeof(uint32_t));
    }
    const auto & idxs = sinfo.idxs[0];
    if (std::any_of(ords.begin(), ords.end(), [&](uint32_t o) { return o >= idxs.size(); })) {
        LLAMA_LOG_ERROR("%s: the state's window section names a cell it does not hold\n", __func__);
        return false;
    }
    if (n_rows > 0 && (win == 0 || win_layout() != std::make_pair(n_layer, row_bytes) || win_free.size() < n_rows)) {
        // another window layout, or none here: those keys are read packed, as without a window
        if (win > 0) {
            LLAMA_LOG_WARN("%s: %u window rows of the state do not fit this context's window: their keys are read packed\n",
                    __func__, n_rows);
        }
        std::vector<uint8_t> skip(row_bytes);
        for (uint32_t r = 0; r < n_rows; ++r) {
            io.read(skip.data(), skip.size());
        }
        return true;
    }
    std::vector<int32_t> rows(n_rows);
    for (uint32_t k = 0; k < n_rows; ++k) {
        const int64_t c = (int64_t) strm*kv.get_size() + idxs[ords[k]];
        if (win_row_of_cell[c] >= 0) {
            win_release(win_row_of_cell[c]);
        }
        rows[k] = win_free.back();
        win_free.pop_back();
        win_row_of_cell[c]       = rows[k];
        win_cell_of_row[rows[k]] = c;
        win_pos_of_row[rows[k]]  = kv.v_cells[strm].pos_get(idxs[ords[k]]);
    }
    for (size_t i = 0; i < k_win.size(); ++i) {
        for (ggml_tensor * t : { k_win[i], v_win[i] }) {
            for (uint32_t k = 0; t && k < n_rows; ++k) {
                io.read_tensor(t, rows[k]*t->nb[1], t->nb[1]);
            }
        }
    }
    return true;
}

void llama_kv_rq::batch(const llama_batch_allocr & balloc) {
    if (dfr_budget == 0) {
        return;
    }
    // a sequence with several tokens in the batch is processing a prompt (or a draft to verify); one token is a
    // decode step. Judged per batch: the ubatches of a prompt can hold a single token of it
    for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
        dfr_prompt[s] = balloc.seq_pos_max(s) > balloc.seq_pos_min(s);
    }
}

bool llama_kv_rq::ubatch(const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ub) {
    win_ubatch(sinfo, ub);
    dfr_w.clear();
    dfr_rows.clear();
    dfr_cells.clear();
    dfr_in_place = false;
    if (dfr_budget == 0) {
        return false;
    }

    const uint32_t kv_size = kv.get_size();

    // a single token is a decode step: the sequence reads the quantised cache from now on
    if (dfr_used > 0) {
        for (uint32_t i = 0; i < ub.n_seqs_unq; ++i) {
            const llama_seq_id seq_id = ub.seq_id_unq[i];
            if (dfr_prompt[seq_id]) {
                continue;
            }
            release_seq(seq_id);
        }
        drop_stale();
    }

    dfr_w.assign(ub.n_tokens, dfr_budget); // the spare row
    uint32_t n_prompt = 0;
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const uint32_t i = s*sinfo.size() + ii;
            const int64_t  c = (int64_t) sinfo.strm[s]*kv_size + sinfo.idxs[s][ii];
            if (dfr_row_of_cell[c] >= 0) {
                release(dfr_row_of_cell[c]);
            }
            if (!dfr_prompt[ub.seq_id[i][0]]) {
                continue;
            }
            n_prompt++;
            if (dfr_free.empty()) {
                if (!dfr_full_logged) {
                    LLAMA_LOG_WARN("%s: deferred prefill: the transient (%u cells) is full; further prompt tokens "
                            "attend to the quantised cache (raise --kv-deferred-budget)\n", __func__, dfr_budget);
                    dfr_full_logged = true;
                }
                continue;
            }
            if (dfr_used == 0) {
                for (size_t j = 0; j < dfr_ctxs_bufs.size(); ++j) {
                    auto & [ctx, buf] = dfr_ctxs_bufs[j];
                    // not cleared: pages a row never touches are never made resident
                    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), dfr_bufts[j]));
                    if (!buf) {
                        throw std::runtime_error("failed to allocate the deferred-prefill transient");
                    }
                }
            }
            const int32_t r = dfr_free.back();
            dfr_free.pop_back();
            dfr_used++;
            dfr_row_of_cell[c] = r;
            dfr_cell_of_row[r] = c;
            dfr_pos_of_row[r]  = ub.pos[i];
            dfr_w[i] = r;
            add_bytes((int64_t) dfr_row_bytes);
        }
    }

    if (n_prompt == 0 || dfr_used == 0) {
        dfr_w.clear();
        return false;
    }

    // One prompt in a fresh cache (the common case) takes rows in cell order, so each attended cell is its own row
    // or an empty cell over a free row. The ubatch then attends the transient in place (build_attn): no dequantised
    // copy of the cache, which on a small model cost ~10% of a long prefill. Free rows in view are zeroed: their
    // cells are masked, but old contents could hold a non-finite value, and 0 * inf is NaN in a kernel that
    // multiplies masked weights instead of skipping them.
    const uint32_t n_kv = kv.get_n_kv(sinfo);
    dfr_in_place = sinfo.s0 == sinfo.s1 && n_kv <= dfr_budget;
    const int64_t c0 = (int64_t) sinfo.s0*kv_size;
    for (uint32_t j = 0; j < n_kv && dfr_in_place; ++j) {
        const int32_t r = dfr_row_of_cell[c0 + j];
        dfr_in_place = r == (int32_t) j || (r < 0 && dfr_cell_of_row[j] < 0 && kv.v_cells[sinfo.s0].is_empty(j));
    }
    for (uint32_t j = 0; j < n_kv && dfr_in_place; ) {
        uint32_t e = j;
        while (e < n_kv && dfr_cell_of_row[e] < 0) {
            ++e;
        }
        for (const auto * side : { &k_dfr, &v_dfr }) {
            for (ggml_tensor * t : *side) {
                if (t && e > j) {
                    ggml_backend_tensor_memset(t, 0, j*t->nb[1], (e - j)*t->nb[1]);
                }
            }
        }
        j = e + 1;
    }
    if (!dfr_in_place) {
        rq_rows_in_view(dfr_cell_of_row, kv_size, sinfo, n_kv, [&](uint32_t r, int64_t j) {
            dfr_rows.push_back(r);
            dfr_cells.push_back(j);
        });
    }

    return true;
}

void llama_kv_rq::build_input(ggml_context * ctx, llama_rq_dfr_inputs & inp) const {
    if (!win_w.empty()) {
        const int64_t ns = win_ns, n_kv = (int64_t) win_rows.size()/ns;
        inp.win_w     = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, win_w.size());
        inp.win_rows  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, ns);
        inp.win_until = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, ns);
        inp.win_qpos  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, (int64_t) win_qpos.size()/ns, ns);
        const std::pair<ggml_tensor *, const char *> ins[] = { {inp.win_w, "attn_inp_win_w"}, {inp.win_rows, "attn_inp_win_rows"},
            {inp.win_until, "attn_inp_win_until"}, {inp.win_qpos, "attn_inp_win_qpos"} };
        for (const auto & [t, name] : ins) {
            ggml_set_input(t);
            ggml_set_name(t, name);
        }
    }
    if (dfr_w.empty()) {
        return;
    }
    inp.w_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, dfr_w.size());
    ggml_set_input(inp.w_rows);
    ggml_set_name(inp.w_rows, "attn_inp_dfr_w");
    if (!dfr_rows.empty()) {
        inp.rows  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, dfr_rows.size());
        inp.cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, dfr_cells.size());
        ggml_set_input(inp.rows);
        ggml_set_input(inp.cells);
        ggml_set_name(inp.rows,  "attn_inp_dfr_rows");
        ggml_set_name(inp.cells, "attn_inp_dfr_cells");
    }
}

void llama_kv_rq::set_input(const llama_rq_dfr_inputs & inp) const {
    const std::pair<ggml_tensor *, const void *> ins[] = {
        { inp.w_rows, dfr_w.data() }, { inp.rows, dfr_rows.data() }, { inp.cells, dfr_cells.data() },
        { inp.win_w, win_w.data() }, { inp.win_rows, win_rows.data() }, { inp.win_until, win_until.data() },
        { inp.win_qpos, win_qpos.data() } };
    for (const auto & [t, src] : ins) {
        if (t && t->buffer) {
            GGML_ASSERT(ggml_backend_buffer_is_host(t->buffer));
            memcpy(t->data, src, ggml_nbytes(t));
        }
    }
}

namespace {
class llama_rq_win_shift : public llm_graph_input_i {
public:
    explicit llama_rq_win_shift(llama_kv_rq * rq) : rq(rq) {}
    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        rq->set_window_shift(shift);
    }
    ggml_tensor * shift = nullptr; // I32 [win_budget + 1]: each pool row's cell shift, 0 for free rows
    llama_kv_rq * rq;
};
} // namespace

ggml_tensor * llama_kv_rq::window_shift_input(llm_graph_result * res, ggml_context * ctx) {
    if (win == 0 || std::none_of(k_win.begin(), k_win.end(), [](const ggml_tensor * t) { return t != nullptr; })) {
        return nullptr;
    }
    auto inp = std::make_unique<llama_rq_win_shift>(this);
    inp->shift = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, win_budget + 1);
    ggml_set_input(inp->shift);
    ggml_set_name(inp->shift, "rq_win_shift");
    ggml_tensor * t = inp->shift;
    res->add_input(std::move(inp));
    return t;
}

void llama_kv_rq::window_shift(ggml_context * ctx, ggml_cgraph * gf, const llama_cparams & cparams, int32_t il,
        ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors, float freq_base, float freq_scale) const {
    const int32_t ikv = kv.map_layer_ids.at(il);
    ggml_tensor * kw = shift ? k_win[ikv] : nullptr;
    if (!kw || kv.hparams.n_lora_kv > 0) {
        return; // MLA caches keep their rows unshifted: they are dropped as before
    }
    const int64_t n_embd_head_k = kv.hparams.n_embd_head_k(il);
    ggml_tensor * k = ggml_view_3d(ctx, kw, k_center(il).k_scale ? n_embd_head_k : kv.hparams.n_rot(il),
            kv.hparams.n_head_kv(il), kw->ne[1], ggml_row_size(kw->type, n_embd_head_k), kw->nb[1], 0);
    ggml_build_forward_expand(gf, kv.build_rope_shift(cparams, ctx, k, shift, rot, factors, freq_base, freq_scale, il));
}

void llama_kv_rq::set_window_shift(ggml_tensor * shift) {
    GGML_ASSERT(shift->buffer && ggml_backend_buffer_is_host(shift->buffer));
    int32_t * d = (int32_t *) shift->data;
    std::fill(d, d + win_budget + 1, 0);
    for (uint32_t r = 0; r < win_budget; ++r) {
        // the row was written at win_pos_of_row; its cell moved from pos - shift to pos since
        const int64_t c = win_cell_of_row[r];
        if (c >= 0 && cell_moved_from(c, win_pos_of_row[r])) {
            const auto & cells = kv.v_cells[c/kv.get_size()];
            d[r] = cells.get_shift(c % kv.get_size());
            win_pos_of_row[r] = cells.pos_get(c % kv.get_size());
        }
    }
}

bool llama_kv_rq::window_fits(const llama_rq_dfr_inputs & inp) const {
    if (win_w.empty()) {
        return inp.win_w == nullptr;
    }
    return inp.win_w && ggml_nelements(inp.win_w) == (int64_t) win_w.size() && inp.win_rows->ne[1] == (int64_t) win_ns &&
           ggml_nelements(inp.win_rows) == (int64_t) win_rows.size() && ggml_nelements(inp.win_qpos) == (int64_t) win_qpos.size();
}

std::pair<ggml_tensor *, ggml_tensor *> llama_kv_rq::build_window(ggml_context * ctx, ggml_cgraph * gf,
        const llama_rq_dfr_inputs & inp, ggml_tensor * k_cur, ggml_tensor * v_cur, int32_t il, bool attend) const {
    const int32_t ikv = kv.map_layer_ids.at(il);
    if (!inp.win_w || !k_win[ikv] || !k_cur || !v_cur) {
        return { nullptr, nullptr };
    }
    // the pool after the ubatch's tokens that stay went in, then those tokens' rows as F16 (the same rounding as the
    // pool's): the kernel's source of exact rows, the ubatch's own at win_budget + 1 + i
    const auto write = [&](ggml_tensor * rows, ggml_tensor * cur) {
        cur = ggml_is_contiguous(cur) ? cur : ggml_cont(ctx, cur);
        cur = ggml_reshape_2d(ctx, cur, rows->ne[0], ggml_nelements(cur)/rows->ne[0]);
        ggml_tensor * w = ggml_set_rows(ctx, rows, cur, inp.win_w);
        ggml_build_forward_expand(gf, w);
        if (!attend) {
            return (ggml_tensor *) nullptr;
        }
        // in the graph now: attached to the attention after it joined the graph, it would not be computed
        ggml_tensor * x = ggml_concat(ctx, w, ggml_cast(ctx, cur, GGML_TYPE_F16), 1);
        ggml_build_forward_expand(gf, x);
        return x;
    };
    // the attention's inputs join the graph here too: it may already hold the attention when they are attached.
    // Only then: as leaves no node reads, ggml-alloc would not check their sizes when it reuses the last graph's
    // layout, and a larger n_kv would overlap them with the inputs after them
    if (attend) {
        for (ggml_tensor * t : { inp.win_rows, inp.win_until, inp.win_qpos }) {
            ggml_build_forward_expand(gf, t);
        }
    }
    return { write(k_win[ikv], k_cur), write(v_win[ikv], v_cur) };
}

void llama_kv_rq::build_attn(ggml_context * ctx, ggml_cgraph * gf, const llama_rq_dfr_inputs & inp,
        ggml_tensor * k_raw, ggml_tensor * v_raw, ggml_tensor *& k, ggml_tensor *& v,
        ggml_tensor * k_rot, ggml_tensor * v_rot, int32_t il, uint32_t n_kv) const {
    const int32_t ikv = kv.map_layer_ids.at(il);

    // the cache in the model's basis, F16, with the transient's exact rows in place of their cells
    const auto attend = [&](ggml_tensor * view, ggml_tensor * dfr, ggml_tensor * raw, ggml_tensor * rot, bool is_k) {
        const int64_t n_embd_gqa = dfr->ne[0];
        ggml_tensor * src = dfr;
        if (raw) {
            raw = ggml_is_contiguous(raw) ? raw : ggml_cont(ctx, raw);
            src = ggml_set_rows(ctx, dfr, ggml_reshape_2d(ctx, raw, n_embd_gqa, ggml_nelements(raw)/n_embd_gqa), inp.w_rows);
            ggml_build_forward_expand(gf, src);
        }
        if (dfr_in_place) {
            GGML_ASSERT(view->ne[2] == (int64_t) n_kv && view->ne[3] == 1 && view->ne[0]*view->ne[1] == n_embd_gqa);
            return ggml_view_4d(ctx, src, view->ne[0], view->ne[1], n_kv, 1, ggml_row_size(src->type, view->ne[0]),
                                src->nb[1], src->nb[1]*n_kv, 0);
        }
        ggml_tensor * x = rot || (is_k && kc[ikv].k_scale) ? ggml_cast(ctx, to_model_basis(ctx, view, rot, il, is_k), GGML_TYPE_F16)
                                                           : ggml_cast(ctx, view, GGML_TYPE_F16);
        if (inp.rows) {
            ggml_tensor * x2 = ggml_reshape_2d(ctx, x, n_embd_gqa, ggml_nelements(x)/n_embd_gqa);
            x2 = ggml_set_rows(ctx, x2, ggml_get_rows(ctx, src, inp.rows), inp.cells);
            x  = ggml_reshape_4d(ctx, x2, view->ne[0], view->ne[1], view->ne[2], view->ne[3]);
        }
        GGML_ASSERT(x->ne[2] == (int64_t) n_kv);
        return x;
    };

    if (k_dfr[ikv]) {
        k = attend(k, k_dfr[ikv], k_raw, k_rot, true);
    }
    if (v_dfr[ikv]) {
        GGML_ASSERT(!kv.v_trans);
        v = attend(v, v_dfr[ikv], v_raw, v_rot, false);
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

void llama_rq_attn::window(ggml_tensor * k_cur, ggml_tensor * v_cur) {
    if (inp.win_w && !g.cparams.training) {
        // a ubatch that attends through the deferred transient reads F16 K/V: it only writes the rows
        std::tie(k_win, v_win) = mctx->get_rq()->build_window(g.ctx0, g.gf, inp, k_cur, v_cur, il, !dfr);
    }
}

void llama_rq_attn::window_attend() const {
    if (!k_win) {
        return;
    }
    // the layer's flash attention, as build_attn_mha recorded it; a prompt that attends through the deferred
    // transient (F16 V) or the unfused path only wrote its rows
    const auto & fused = g.res->get_fused_nodes();
    ggml_tensor * fa = !fused.empty() && fused.back().op == LLM_FUSED_OP_FLASH_ATTN && fused.back().il == il ? fused.back().tensor : nullptr;
    if (fa && ggml_rq_type_is_iso(fa->src[2]->type)) {
        ggml_rq_flash_attn_ext_set_exact(fa, k_win, v_win, inp.win_rows, inp.win_until, inp.win_qpos);
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

// trailer: u64 FNV-1a of every byte before it, then this magic ("rqsm")
static constexpr uint32_t LLAMA_RQ_SUM_MAGIC = 0x6d737172u;

static bool rq_file_sum(FILE * f, long n, uint64_t & h) {
    uint8_t buf[1 << 16];
    h = 0xcbf29ce484222325ull;
    for (long done = 0; done < n; ) {
        const size_t k = fread(buf, 1, (size_t) std::min<long>(n - done, sizeof(buf)), f);
        if (k == 0) {
            return false;
        }
        for (size_t i = 0; i < k; ++i) {
            h = (h ^ buf[i]) * 0x100000001b3ull;
        }
        done += (long) k;
    }
    return true;
}

void llama_rq_state_file_seal(const char * path) {
    FILE * f = ggml_fopen(path, "r+b");
    uint64_t h;
    if (f == nullptr || fseek(f, 0, SEEK_END) != 0) {
        LLAMA_LOG_WARN("%s: %s: cannot reopen to add its checksum\n", __func__, path);
    } else {
        const long n = ftell(f);
        rewind(f);
        if (!rq_file_sum(f, n, h) || fseek(f, 0, SEEK_END) != 0 || fwrite(&h, sizeof(h), 1, f) != 1 ||
            fwrite(&LLAMA_RQ_SUM_MAGIC, sizeof(uint32_t), 1, f) != 1) {
            LLAMA_LOG_WARN("%s: %s: checksum not written\n", __func__, path);
        }
    }
    if (f) {
        fclose(f);
    }
}

bool llama_rq_state_file_check(const char * path) {
    FILE * f = ggml_fopen(path, "rb");
    if (f == nullptr) {
        return true; // the loader reports a missing file
    }
    bool ok = true;
    uint64_t stored = 0, h = 0;
    uint32_t magic = 0;
    const long tail = (long) (sizeof(stored) + sizeof(magic));
    if (fseek(f, 0, SEEK_END) == 0 && ftell(f) >= tail) {
        const long n = ftell(f) - tail;
        if (fseek(f, n, SEEK_SET) == 0 && fread(&stored, sizeof(stored), 1, f) == 1 &&
            fread(&magic, sizeof(magic), 1, f) == 1 && magic == LLAMA_RQ_SUM_MAGIC) {
            rewind(f);
            ok = rq_file_sum(f, n, h) && h == stored;
            if (!ok) {
                LLAMA_LOG_ERROR("%s: %s is corrupted: its checksum is %016" PRIx64 ", its bytes sum to %016" PRIx64
                                "; nothing was loaded\n", __func__, path, stored, h);
            }
        }
    }
    fclose(f);
    return ok;
}
