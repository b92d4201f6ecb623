// Per-layer K/V cache types (llama-rq.h): the kv_layer_types spec, the allocation rq-calibrate stored in the model,
// and the default a context takes when it names none.

#include "llama-rq.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-rq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

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

// the model's per-layer allocation (rq-calibrate --kv-bits)
static std::string rq_model_layer_types(const llama_model & model) {
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

// bits per cached value of one sequence's caches with K of the layers in `up` at type k4 (the others at type_k), as
// llama.cpp's tools size them by default: full-attention caches of n_ctx_seq cells, sliding-window ones of n_swa +
// 512 (the default ubatch) padded to 256, and the default recent window's 16+1 F16 rows beside a layer whose V is
// IsoQuant. What the tools' size lines and init_window log with their defaults. It depends on the model, n_ctx_seq and
// the types only: a context with another window, ubatch, sequence count or full-size sliding-window caches (swa_full:
// llama.h's default, Llama(...) too) takes the same types, so state files and A/B runs (window on/off, fused/unfused)
// see one cache layout.
static double rq_cache_bits(const llama_hparams & hp, ggml_type type_k, ggml_type type_v, uint32_t n_ctx_seq,
                            const std::vector<uint32_t> & up, ggml_type k4) {
    const uint32_t size_swa = GGML_PAD(std::min(n_ctx_seq, hp.n_swa + 512), 256);
    const uint64_t win_rows = LLAMA_RQ_KV_WINDOW_DEFAULT + 1;
    double bytes = 0, values = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.has_kv(il)) {
            continue;
        }
        const bool     is_up = std::find(up.begin(), up.end(), il) != up.end();
        const uint32_t nk = hp.n_embd_k_gqa(il), nv = hp.n_embd_v_gqa(il);
        const ggml_type tk = rq_kv_type_for_head(is_up ? k4 : type_k, hp.n_embd_head_k(il), il, "K");
        const ggml_type tv = rq_kv_type_for_head(type_v, hp.n_embd_head_v(il), il, "V");
        const double cells = hp.is_swa(il) ? size_swa : n_ctx_seq;
        bytes  += cells*(ggml_row_size(tk, nk) + ggml_row_size(tv, nv));
        values += cells*(nk + nv);
        bytes  += ggml_rq_type_is_iso(tv) ? win_rows*(ggml_row_size(GGML_TYPE_F16, nk) + ggml_row_size(GGML_TYPE_F16, nv)) : 0;
    }
    return values > 0 ? 8*bytes/values : 0;
}

// The candidate layers of the default, best first, and why them (empty: none).
// - A model whose full-attention layers are a minority beside sliding-window ones: those few layers alone reach past
//   the window, and their 3-bit K is where long-context retrieval is lost (Gemma3-270M, 16K needles: 18/24 with 3-bit K
//   everywhere, 24/24 with 4-bit K on its 3 full layers, 23/24 on the middle one alone, 22/24 on the first, 18/24 on
//   the last). Middle layer outwards: a prior from those rows, not a per-model measurement.
// - A model of full-attention layers only: ranked by the K statistics' copy task (llama_rq_copy_task), most retrieval
//   lost at 3 bits first (Qwen2.5-Coder-1.5B at 2K: KLD 0.0196 with 4-bit K on the six it ranks first, 0.0221 on
//   layers 0-5, at the same bits). No ranking, no candidates: a calibrated model (rq-calibrate stores none), K centring off. A dry run
//   (no_alloc) measures nothing and takes the last layers first, which costs the same bytes.
static std::vector<uint32_t> rq_default_candidates(const llama_model & model, const llama_context_params & params,
                                                   std::string & why) {
    const llama_hparams & hp = model.hparams;
    std::vector<uint32_t> full;
    uint32_t n_swa_layers = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.has_kv(il) && hp.is_swa(il)) {
            ++n_swa_layers;
        } else if (hp.has_kv(il)) {
            full.push_back(il);
        }
    }
    if (hp.swa_type != LLAMA_SWA_TYPE_NONE) {
        if (full.empty() || full.size() >= n_swa_layers) {
            return {};
        }
        const double mid = (full.size() - 1)/2.0;
        std::vector<uint32_t> order(full.size());
        for (size_t i = 0; i < order.size(); ++i) {
            order[i] = (uint32_t) i;
        }
        // of two at the same distance, the earlier
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return std::abs(a - mid) < std::abs(b - mid); });
        for (uint32_t & i : order) {
            i = full[i];
        }
        why = "full-attention layers, middle outwards";
        return order;
    }
    if (params.k_center == LLAMA_K_CENTER_OFF || !model.rq_k_center.off.empty()) {
        return {};
    }
    const llama_rq_k_center_self * s = llama_rq_k_stats(model);
    if (s && s->retrieval.size() == hp.n_layer_all) {
        std::vector<uint32_t> order;
        for (uint32_t il : full) {
            if (s->retrieval[il] >= 0.0f) {
                order.push_back(il);
            }
        }
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return s->retrieval[a] > s->retrieval[b]; });
        why = "ranked by the retrieval 3-bit K loses in the K statistics' copy task";
        return order;
    }
    if (hp.no_alloc && model.rq_k_center.self) {
        why = "a dry run's stand-in for the measured ranking";
        return std::vector<uint32_t>(full.rbegin(), full.rend());
    }
    return {};
}

// 4-bit K on the candidates in order while one sequence's cache, as the tools size it by default, stays within
// LLAMA_RQ_KV_AUTO_BITS bits per value at this context's n_ctx_seq (rq_cache_bits)
static std::string rq_default_layer_types(const llama_model & model, const llama_context_params & params,
                                          const llama_cparams & cparams) {
    const llama_hparams & hp = model.hparams;
    if (!ggml_rq_type_is_iso(params.type_k) || ggml_rq_iso_bits(params.type_k) != 3 || hp.n_layer_kv_from_start >= 0 ||
        llama_rq_arch_unhooked(model.arch)) {
        return "";
    }
    std::string why;
    const std::vector<uint32_t> order = rq_default_candidates(model, params, why);
    if (order.empty()) {
        return "";
    }
    const ggml_type k4 = ggml_rq_iso_type(4, ggml_rq_iso_qk(params.type_k));
    std::vector<uint32_t> up;
    double bits = rq_cache_bits(hp, params.type_k, params.type_v, cparams.n_ctx_seq, up, k4);
    for (uint32_t il : order) {
        up.push_back(il);
        const double b = rq_cache_bits(hp, params.type_k, params.type_v, cparams.n_ctx_seq, up, k4);
        if (b > LLAMA_RQ_KV_AUTO_BITS) {
            up.pop_back();
            break;
        }
        bits = b;
    }
    if (up.empty()) {
        LLAMA_LOG_INFO("%s: per-layer K/V types = uniform (default: 4-bit K on one more layer would take the cache past "
                       "%.2f bits/value at %u cells, it is at %.2f)\n", __func__, LLAMA_RQ_KV_AUTO_BITS, cparams.n_ctx_seq, bits);
        return "";
    }
    std::sort(up.begin(), up.end());
    std::string spec, layers;
    for (uint32_t il : up) {
        spec   += format("%s%u=%s/%s", spec.empty() ? "" : ",", il, ggml_type_name(k4), ggml_type_name(params.type_v));
        layers += format("%s%u", layers.empty() ? "" : " ", il);
    }
    LLAMA_LOG_INFO("%s: per-layer K/V types (default): K of layer(s) %s at 4 bits, %.2f bits/value at %u cells (within "
                   "%.2f; %s); --kv-layer-types none keeps every layer at %s\n", __func__, layers.c_str(), bits,
                   cparams.n_ctx_seq, LLAMA_RQ_KV_AUTO_BITS, why.c_str(), ggml_type_name(params.type_k));
    return spec;
}

std::string llama_rq_kv_layer_types(const llama_model & model, const llama_context_params & params,
                                    const llama_cparams & cparams) {
    const char * spec = params.kv_layer_types;
    if (spec && strcmp(spec, "none") == 0) {
        return "";
    }
    if (spec && strcmp(spec, "model") == 0) {
        return rq_model_layer_types(model);
    }
    return spec && *spec ? spec : rq_default_layer_types(model, params, cparams);
}
