// K statistics and K centring (llama-rq.h): the model's calibration (rotaryquant.k_center, written by rq-calibrate)
// or, for a model without one, statistics measured from the model itself once and kept in a stats file named by the
// model's content, so that later starts load them instead of measuring again; and the per-layer tensors through which
// a cache centres its keys with them.

#include "llama-rq.h"
#include "llama-rq-impl.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model-loader.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "gguf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <system_error>

// llama-impl.cpp drops this thread's INFO/DEBUG lines while it is set: the measuring pass creates a context of its own,
// whose set-up lines would read as the caller's (set only around that pass, on the thread that runs it)
thread_local bool llama_rq_log_quiet = false;

//
// rotaryquant.k_center.* (stock builds ignore the unknown keys)
//

static constexpr uint32_t RQ_K_CENTER_VERSION = 1;

// mu/lam of rotaryquant.k_center.* in ctx; throws saying what is wrong (the caller adds the fix)
static void rq_k_center_parse(const gguf_context * ctx, const llama_hparams & hparams, llama_rq_k_center_data & out) {
    const int kid_ver = gguf_find_key(ctx, "rotaryquant.k_center.version");
    const uint32_t ver = kid_ver >= 0 && gguf_get_kv_type(ctx, kid_ver) == GGUF_TYPE_UINT32 ? gguf_get_val_u32(ctx, kid_ver) : 0;
    if (ver != RQ_K_CENTER_VERSION) {
        throw std::runtime_error(format("rotaryquant.k_center.version %u is not supported by this build (%u)", ver,
                                        RQ_K_CENTER_VERSION));
    }
    auto arr = [&](const char * key, gguf_type type) -> int {
        const int kid = gguf_find_key(ctx, key);
        if (kid < 0 || gguf_get_kv_type(ctx, kid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, kid) != type) {
            throw std::runtime_error(format("%s is missing or not an array of %s", key, gguf_type_name(type)));
        }
        return kid;
    };
    const int kid_l  = arr("rotaryquant.k_center.layers", GGUF_TYPE_INT32);
    const int kid_mu = arr("rotaryquant.k_center.mean",   GGUF_TYPE_FLOAT32);
    const int kid_s  = arr("rotaryquant.k_center.scale",  GGUF_TYPE_FLOAT32);

    const uint32_t n_layer = hparams.n_layer_all;
    const int32_t * il_arr = (const int32_t *) gguf_get_arr_data(ctx, kid_l);
    std::vector<int32_t> off(n_layer, -1);
    size_t n = 0;
    for (size_t i = 0; i < gguf_get_arr_n(ctx, kid_l); ++i) {
        const int32_t il = il_arr[i];
        if (il < 0 || (uint32_t) il >= n_layer || !hparams.has_kv(il) || off[il] >= 0) {
            throw std::runtime_error(format("rotaryquant.k_center belongs to another model: it lists layer %d, which "
                "has no KV cache in this model", il));
        }
        off[il] = (int32_t) n;
        n += hparams.n_embd_k_gqa(il);
    }
    if (gguf_get_arr_n(ctx, kid_mu) != n || gguf_get_arr_n(ctx, kid_s) != n) {
        throw std::runtime_error(format("rotaryquant.k_center belongs to another model: it has %zu/%zu values where "
            "this model needs %zu", gguf_get_arr_n(ctx, kid_mu), gguf_get_arr_n(ctx, kid_s), n));
    }
    const float * mu  = (const float *) gguf_get_arr_data(ctx, kid_mu);
    const float * lam = (const float *) gguf_get_arr_data(ctx, kid_s);
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(mu[i]) || !std::isfinite(lam[i]) || !(lam[i] > 0.0f)) {
            throw std::runtime_error("rotaryquant.k_center holds a non-finite mean or a non-positive scale");
        }
    }
    out.off = std::move(off);
    out.mu.assign(mu, mu + n);
    out.lam.assign(lam, lam + n);
}

static void rq_k_center_write(gguf_context * ctx, const llama_rq_k_center_data & d) {
    std::vector<int32_t> layers;
    for (size_t il = 0; il < d.off.size(); ++il) {
        if (d.off[il] >= 0) {
            layers.push_back((int32_t) il); // d.mu holds the layers in this order (rq_k_stats_measure)
        }
    }
    gguf_set_val_u32(ctx, "rotaryquant.k_center.version", RQ_K_CENTER_VERSION);
    gguf_set_arr_data(ctx, "rotaryquant.k_center.layers", GGUF_TYPE_INT32,   layers.data(), layers.size());
    gguf_set_arr_data(ctx, "rotaryquant.k_center.mean",   GGUF_TYPE_FLOAT32, d.mu.data(),   d.mu.size());
    gguf_set_arr_data(ctx, "rotaryquant.k_center.scale",  GGUF_TYPE_FLOAT32, d.lam.data(),  d.lam.size());
}

//
// the model's content identity
//

namespace {
struct rq_fnv64 {
    uint64_t h = 0xcbf29ce484222325ull;
    void add(const void * p, size_t n) {
        const uint8_t * b = (const uint8_t *) p;
        for (size_t i = 0; i < n; ++i) {
            h = (h ^ b[i])*0x100000001b3ull;
        }
    }
};
}

// its GGUF metadata and tensor table as serialised (gguf_get_meta_data), and 3 x 32 bytes (start, middle, end) of
// every tensor's data read from the file: a copy of the file under another path or date finds its statistics, a file
// with other weights under the same names (a fine-tune, another quantisation) does not. About 10 ms for a 1.5B model.
static std::string rq_model_id(llama_model_loader & ml) {
    rq_fnv64 h;
    std::vector<uint8_t> meta(gguf_get_meta_size(ml.metadata));
    gguf_get_meta_data(ml.metadata, meta.data());
    h.add(meta.data(), meta.size());
    for (const auto & [name, w] : ml.weights_map) {
        const size_t nb = ggml_nbytes(w.tensor);
        h.add(name.data(), name.size());
        h.add(&nb, sizeof(nb));
        if (w.idx >= ml.files.size() || nb < 32) {
            continue;
        }
        llama_file * f = ml.files[w.idx].get();
        const size_t pos = f->tell();
        for (size_t at : { (size_t) 0, (nb/2) & ~(size_t) 31, nb - 32 }) {
            uint8_t buf[32];
            f->seek(w.offs + at, SEEK_SET);
            f->read_raw(buf, sizeof(buf));
            h.add(buf, sizeof(buf));
        }
        f->seek(pos, SEEK_SET);
    }
    char id[17];
    snprintf(id, sizeof(id), "%016llx", (unsigned long long) h.h);
    return id;
}

void llama_rq_load_k_center(llama_model_loader & ml, const llama_hparams & hparams, llama_rq_k_center_data & out) {
    out.self = std::make_shared<llama_rq_k_center_self>();
    if (gguf_find_key(ml.metadata, "rotaryquant.k_center.version") >= 0) {
        try {
            rq_k_center_parse(ml.metadata, hparams, out);
        } catch (const std::exception & e) {
            throw std::runtime_error(std::string(e.what()) + "; re-run rq-calibrate on this file");
        }
        return;
    }
    if (!hparams.vocab_only) {
        out.self->id = rq_model_id(ml);
    }
}

//
// statistics measured from the model
//

// One forward pass (F16 cache) over RQ_SELF_TOKENS pseudo-random ordinary tokens in RQ_SELF_SEQS sequences (each led
// by BOS) at positions spread over the trained context, with rq-calibrate's statistics (mu = mean of post-RoPE K,
// lam = sqrt(max|K - mu| / max|Q|) per channel). The constant part of K comes from the weights and the model's
// massive activations, not from what the text says: measured on Gemma3-270M (no K bias), 2K KLD of isoquant3_0 0.534
// uncentred, 0.093 with 1024 random tokens, 0.119 with 256 tokens of Shakespeare, 0.079 with rq-calibrate's 4096.
// The tokens come from a fixed mt19937 stream (portable), so the statistics depend on the model only and saved states
// stay valid. RQ_SELF_METHOD names this recipe in stats files (with the token count, checked too): change it with the
// recipe, and older files are measured again instead of used. The token count is sized by compute: RQ_SELF_BUDGET
// parameter-tokens, 160 tokens of Qwen2.5-1.5B (1.78e9 parameters), within [RQ_SELF_TOKENS_MIN, RQ_SELF_TOKENS_MAX]:
// a small model gets 1024 for a second or two, which its far positions need (40 tokens per start position estimate
// mu there worse than 128: decode KLD after an 8K prompt, Gemma3-270M 0.0316 with 1024 tokens, 0.0405 with 320;
// docs/k-center.md), and a large one never pays more than 160 tokens' time plus the copy task's 97 (a large model's K
// mean is mostly its k_proj bias and massive activations, which few tokens find).
static constexpr double   RQ_SELF_BUDGET     = 2.85e11;
static constexpr uint32_t RQ_SELF_TOKENS_MIN = 160;
static constexpr uint32_t RQ_SELF_TOKENS_MAX = 1024;
static constexpr uint32_t RQ_SELF_SEQS   = 8;
static constexpr uint32_t RQ_SELF_METHOD = 3; // 3: with the copy task's retrieval ranking
static constexpr float    RQ_LAM_MIN = 1.0f/256, RQ_LAM_MAX = 256.0f; // rq-calibrate's clip (converter/kcenter.py)

namespace {
struct rq_kc_layer {
    int64_t             n = 0;
    std::vector<double> sum;
    std::vector<float>  kmin, kmax, qmax; // [n_head_kv*hd]
};

struct rq_kc_collect {
    const llama_hparams &    hp;
    std::vector<rq_kc_layer> layers;
    std::vector<uint8_t>     buf;
    bool                     bad = false;
    llama_rq_copy_task *     copy = nullptr; // set while the copy task's sequence runs: its Q/K go there
};

struct rq_log_quiet_scope {
    rq_log_quiet_scope()  { llama_rq_log_quiet = true; }
    ~rq_log_quiet_scope() { llama_rq_log_quiet = false; }
};
}

static bool rq_kc_cb(ggml_tensor * t, bool ask, void * ud) {
    auto * c = (rq_kc_collect *) ud;
    if (c->copy) {
        return ask ? llama_rq_copy_task::wants(t) : (c->copy->take(t, c->buf), true);
    }
    const bool is_k = strncmp(t->name, "attn_k_in-", 10) == 0;
    const bool is_q = strncmp(t->name, "attn_q_in-", 10) == 0;
    if (ask || (!is_k && !is_q)) {
        return is_k || is_q;
    }
    const int il = atoi(t->name + 10);
    if (t->type != GGML_TYPE_F32 || t->ne[3] != 1 || il < 0 || (size_t) il >= c->layers.size() || !c->hp.has_kv(il)) {
        c->bad = c->bad || is_k;
        return true;
    }
    const int64_t hd = c->hp.n_embd_head_k(il), nkv = c->hp.n_head_kv(il);
    auto & L = c->layers[il];
    if (L.sum.empty()) {
        L.sum.assign(hd*nkv, 0.0);
        L.kmin.assign(hd*nkv, INFINITY);
        L.kmax.assign(hd*nkv, -INFINITY);
        L.qmax.assign(hd*nkv, 0.0f);
    }
    if (t->ne[0] != hd || (is_k && t->ne[1] != nkv) || (is_q && t->ne[1] % nkv != 0)) {
        c->bad = true;
        return true;
    }
    if (is_k) {
        L.n += t->ne[2];
        rq_read_f32(t, c->buf, [&](int64_t, int64_t h, int64_t j, float x) {
            const int64_t i = h*hd + j;
            L.sum[i] += x;
            L.kmin[i] = std::min(L.kmin[i], x);
            L.kmax[i] = std::max(L.kmax[i], x);
        });
    } else {
        const int64_t g = t->ne[1]/nkv; // query head h reads KV head h/g
        rq_read_f32(t, c->buf, [&](int64_t, int64_t h, int64_t j, float x) {
            float & m = L.qmax[(h/g)*hd + j];
            m = std::max(m, std::fabs(x));
        });
    }
    return true;
}

// the tokens the recipe measures on: RQ_SELF_BUDGET over the model's parameters, clamped; fewer for a model trained on
// fewer positions
static uint32_t rq_self_n_tokens(const llama_model & model) {
    const llama_hparams & hp = model.hparams;
    const double   by_compute = RQ_SELF_BUDGET/std::max<double>((double) model.n_elements(), 1.0);
    const uint32_t n_want     = (uint32_t) std::clamp(by_compute, (double) RQ_SELF_TOKENS_MIN, (double) RQ_SELF_TOKENS_MAX);
    const uint32_t n          = std::min<uint32_t>(n_want, hp.n_ctx_train > 0 ? hp.n_ctx_train : n_want);
    return n/RQ_SELF_SEQS*RQ_SELF_SEQS;
}

// mu/lam of every layer the pass saw (rq-calibrate's formulas); false: none
static bool rq_k_stats_reduce(const rq_kc_collect & col, llama_rq_k_center_data & d) {
    d.off.assign(col.hp.n_layer_all, -1);
    for (uint32_t il = 0; il < col.hp.n_layer_all; ++il) {
        const rq_kc_layer & L = col.layers[il];
        if (L.n == 0) {
            continue;
        }
        d.off[il] = (int32_t) d.mu.size();
        for (size_t i = 0; i < L.sum.size(); ++i) {
            const float mu   = (float) (L.sum[i]/L.n);
            const float kdev = std::max(L.kmax[i] - mu, mu - L.kmin[i]);
            const float lam  = std::sqrt(std::max(kdev, 1e-6f)/std::max(L.qmax[i], 1e-6f));
            d.mu.push_back(mu);
            d.lam.push_back(std::clamp(lam, RQ_LAM_MIN, RQ_LAM_MAX));
        }
    }
    return !d.mu.empty();
}

static bool rq_k_stats_measure(llama_model & model, int32_t n_threads, llama_rq_k_center_self & out) {
    const llama_hparams & hp    = model.hparams;
    const llama_vocab   & vocab = model.vocab;
    const uint32_t n_tok = rq_self_n_tokens(model);

    std::vector<llama_token> ordinary;
    for (llama_token t = 0; t < (llama_token) vocab.n_tokens(); ++t) {
        if (vocab.token_get_attr(t) & LLAMA_TOKEN_ATTR_NORMAL) {
            ordinary.push_back(t);
        }
    }
    if (ordinary.size() < 16) {
        return false;
    }
    // RQ_SELF_SEQS sequences spread over the trained context, starting at 0 and at 1/64, 1/32 .. 1/2 and the end of
    // it: mu is post-RoPE, and a channel pair's constant turns with the position at its RoPE frequency, so a mean over
    // the first 1024 positions is wrong far from them (SmolLM2 decode KLD after 8K: 0.111 that way, 0.042 spread).
    // Denser near 0 because every context uses the first positions and only long ones the last.
    const uint32_t n_seq = RQ_SELF_SEQS, n_per = n_tok/n_seq;
    const uint32_t span  = std::max<uint32_t>(hp.n_ctx_train > 0 ? hp.n_ctx_train : n_tok, n_tok);
    const bool     bos   = vocab.get_add_bos() && vocab.token_bos() != LLAMA_TOKEN_NULL;
    llama_batch b = llama_batch_init((int32_t) (n_seq*n_per), 0, 1);
    std::mt19937 rng(20260401);
    for (uint32_t s = 0; s < n_seq; ++s) {
        const llama_pos p0 = s == 0 ? 0 : (llama_pos) ((span - n_per) >> (n_seq - 1 - s));
        for (uint32_t i = 0; i < n_per; ++i) {
            const int32_t j = b.n_tokens++;
            b.token[j]     = i == 0 && bos ? vocab.token_bos() : ordinary[rng() % ordinary.size()];
            b.pos[j]       = p0 + (llama_pos) i;
            b.n_seq_id[j]  = 1;
            b.seq_id[j][0] = (llama_seq_id) s;
            b.logits[j]    = false; // K and Q are computed for every token; no output spares the head
        }
    }

    // the copy task's tokens come after the statistics' in the same stream: those are what they were before it
    llama_rq_copy_task copy(ordinary, rng, bos ? vocab.token_bos() : LLAMA_TOKEN_NULL, hp.n_layer_all);
    const uint32_t n_cells = GGML_PAD(std::max<uint32_t>(n_per, (uint32_t) copy.tokens.size()), 256);

    rq_kc_collect col { hp, std::vector<rq_kc_layer>(hp.n_layer_all), {}, false };
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx       = n_seq*n_cells; // what llama pads each sequence's cells to anyway, without its WARN
    cp.n_batch     = std::max<uint32_t>(b.n_tokens, (uint32_t) copy.tokens.size());
    cp.n_ubatch    = cp.n_batch;
    cp.n_seq_max   = n_seq;
    cp.type_k      = GGML_TYPE_F16;
    cp.type_v      = GGML_TYPE_F16;
    cp.k_center    = LLAMA_K_CENTER_OFF;
    cp.kv_deferred = 0;
    cp.no_perf     = true;
    cp.cb_eval           = rq_kc_cb;
    cp.cb_eval_user_data = &col;
    if (n_threads > 0) {
        cp.n_threads = cp.n_threads_batch = n_threads;
    }
    auto & d = out.data;
    int32_t rc = -1, rc_copy = -1;
    {
        rq_log_quiet_scope quiet;
        llama_context * lctx = llama_init_from_model(&model, cp);
        rc = lctx ? llama_decode(lctx, b) : -1;
        if (rc == 0 && !col.bad && rq_k_stats_reduce(col, d)) {
            // the copy task, alone in a second pass (its rows stay out of mu/lam), scored with the mu/lam just measured
            llama_memory_clear(llama_get_memory(lctx), true);
            llama_batch bc = llama_batch_get_one(copy.tokens.data(), (int32_t) copy.tokens.size());
            col.copy = &copy;
            rc_copy = llama_decode(lctx, bc);
            col.copy = nullptr;
        }
        llama_free(lctx);
    }
    const uint32_t n_done = (uint32_t) b.n_tokens;
    llama_batch_free(b);
    if (rc != 0 || col.bad || d.mu.empty()) {
        d = {};
        return false;
    }
    // the ranking is an extra: without it (-1 everywhere) the default types stay uniform and the statistics stand
    out.retrieval = rc_copy == 0 && !copy.bad ? copy.losses(hp, d, cp.n_threads)
                                              : std::vector<float>(hp.n_layer_all, -1.0f);
    out.n_tokens  = n_done;
    return true;
}

//
// the stats file: a GGUF of metadata only, rotaryquant.k_center.* beside what identifies the measurement
//

static constexpr uint32_t RQ_STATS_VERSION = 1;

static std::string rq_k_stats_file(const std::string & path, const std::string & id) {
    const bool is_file = path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0;
    return is_file ? path : (std::filesystem::u8path(path) / ("k-stats-" + id + ".gguf")).u8string();
}

// "" when the file holds this model's statistics (then in out), else why it is refused
static std::string rq_k_stats_read(const std::string & file, const llama_model & model, llama_rq_k_center_self & out) {
    const llama_hparams & hp = model.hparams;
    gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context_ptr ctx(gguf_init_from_file(file.c_str(), gp));
    if (!ctx) {
        return "not a readable GGUF file (truncated or corrupt)";
    }
    auto u32 = [&](const char * key) -> int64_t {
        const int kid = gguf_find_key(ctx.get(), key);
        return kid >= 0 && gguf_get_kv_type(ctx.get(), kid) == GGUF_TYPE_UINT32 ? gguf_get_val_u32(ctx.get(), kid) : -1;
    };
    const int64_t ver = u32("rotaryquant.k_stats.version");
    if (ver != RQ_STATS_VERSION) {
        return format("written in another format (rotaryquant.k_stats.version %lld, this build reads %u)", (long long) ver,
                      RQ_STATS_VERSION);
    }
    const int kid_id = gguf_find_key(ctx.get(), "rotaryquant.k_stats.model_id");
    const std::string id = kid_id >= 0 && gguf_get_kv_type(ctx.get(), kid_id) == GGUF_TYPE_STRING
                           ? gguf_get_val_str(ctx.get(), kid_id) : "";
    if (id != out.id) {
        return format("measured on another model (model id %s, this model's %s)", id.c_str(), out.id.c_str());
    }
    const int64_t method = u32("rotaryquant.k_stats.method");
    const int64_t n_tok  = u32("rotaryquant.k_stats.n_tokens");
    if (method != RQ_SELF_METHOD || n_tok != rq_self_n_tokens(model)) {
        return format("stale: measured by another recipe (rotaryquant.k_stats.method %lld on %lld tokens, this "
                      "build's %u on %u)", (long long) method, (long long) n_tok, RQ_SELF_METHOD, rq_self_n_tokens(model));
    }
    try {
        llama_rq_k_center_data d;
        rq_k_center_parse(ctx.get(), hp, d);
        out.data.off = std::move(d.off);
        out.data.mu  = std::move(d.mu);
        out.data.lam = std::move(d.lam);
    } catch (const std::exception & e) {
        return e.what();
    }
    const int kid_r = gguf_find_key(ctx.get(), "rotaryquant.k_stats.retrieval");
    if (kid_r < 0 || gguf_get_kv_type(ctx.get(), kid_r) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx.get(), kid_r) != GGUF_TYPE_FLOAT32 ||
        gguf_get_arr_n(ctx.get(), kid_r) != hp.n_layer_all) {
        out.data = {};
        return format("rotaryquant.k_stats.retrieval is missing or not %u floats (one per layer)", hp.n_layer_all);
    }
    const float * r = (const float *) gguf_get_arr_data(ctx.get(), kid_r);
    if (!std::all_of(r, r + hp.n_layer_all, [](float x) { return std::isfinite(x) && (x >= 0.0f || x == -1.0f); })) {
        out.data = {};
        return "rotaryquant.k_stats.retrieval holds a value that is neither a loss (>= 0) nor -1";
    }
    out.retrieval.assign(r, r + hp.n_layer_all);
    const int kid_s = gguf_find_key(ctx.get(), "rotaryquant.k_stats.seconds");
    out.n_tokens = (uint32_t) n_tok;
    out.secs_measured = kid_s >= 0 && gguf_get_kv_type(ctx.get(), kid_s) == GGUF_TYPE_FLOAT32 ? gguf_get_val_f32(ctx.get(), kid_s) : 0.0;
    return "";
}

// "" when stored: written beside the file and renamed over it, so that a reader never sees half a file
static std::string rq_k_stats_write(const std::string & file, const llama_rq_k_center_self & s) {
    std::error_code ec;
    const std::filesystem::path p = std::filesystem::u8path(file);
    if (p.has_parent_path()) {
        std::filesystem::create_directories(p.parent_path(), ec);
        if (ec) {
            return "cannot create " + p.parent_path().u8string() + ": " + ec.message();
        }
    }
    gguf_context_ptr ctx(gguf_init_empty());
    gguf_set_val_u32(ctx.get(), "rotaryquant.k_stats.version",  RQ_STATS_VERSION);
    gguf_set_val_str(ctx.get(), "rotaryquant.k_stats.model_id", s.id.c_str());
    gguf_set_val_u32(ctx.get(), "rotaryquant.k_stats.method",   RQ_SELF_METHOD);
    gguf_set_val_u32(ctx.get(), "rotaryquant.k_stats.n_tokens", s.n_tokens);
    gguf_set_val_f32(ctx.get(), "rotaryquant.k_stats.seconds",  (float) s.secs_measured);
    rq_k_center_write(ctx.get(), s.data);
    gguf_set_arr_data(ctx.get(), "rotaryquant.k_stats.retrieval", GGUF_TYPE_FLOAT32, s.retrieval.data(), s.retrieval.size());
    const std::string tmp = file + format(".tmp%lld", (long long) ggml_time_us());
    if (!gguf_write_to_file(ctx.get(), tmp.c_str(), /*only_meta =*/ true)) {
        std::filesystem::remove(std::filesystem::u8path(tmp), ec);
        return "cannot write " + tmp;
    }
    std::filesystem::rename(std::filesystem::u8path(tmp), p, ec);
    if (ec) {
        std::filesystem::remove(std::filesystem::u8path(tmp), ec);
        return "cannot rename it to " + file + ": " + ec.message();
    }
    return "";
}

bool llama_rq_measure_k_stats(llama_model * model, const char * path, int32_t n_threads) {
    if (!model) {
        return false;
    }
    if (!model->rq_k_center.off.empty()) {
        return true; // calibrated
    }
    llama_rq_k_center_self * s = model->rq_k_center.self.get();
    if (!s || model->hparams.no_alloc || model->hparams.vocab_only) {
        return false;
    }
    std::lock_guard<std::mutex> lock(s->mtx);
    if (s->done) {
        return !s->data.off.empty();
    }
    s->done = true;
    const std::string file = path && *path ? rq_k_stats_file(path, s->id) : "";
    const int64_t t0 = ggml_time_us();
    std::error_code ec;
    if (!file.empty() && std::filesystem::exists(std::filesystem::u8path(file), ec)) {
        const std::string why = rq_k_stats_read(file, *model, *s);
        if (why.empty()) {
            s->secs = (ggml_time_us() - t0)/1e6;
            s->source = format("loaded from %s in %.2f s; measured once on %u tokens in %.1f s", file.c_str(), s->secs,
                               s->n_tokens, s->secs_measured);
            LLAMA_LOG_DEBUG("%s: K statistics %s\n", __func__, s->source.c_str()); // init_k_center says it
            return true;
        }
        s->data = {};
        s->retrieval.clear();
        LLAMA_LOG_WARN("%s: K statistics in %s refused: %s; measuring them again\n", __func__, file.c_str(), why.c_str());
    }
    LLAMA_LOG_INFO("%s: the model has no rotaryquant.k_center calibration: measuring K statistics for K centring on "
        "%u pseudo-random tokens (once per model%s)\n", __func__, rq_self_n_tokens(*model), file.empty() ? "" : ", kept for later starts");
    if (!rq_k_stats_measure(*model, n_threads, *s)) {
        LLAMA_LOG_WARN("%s: measuring K statistics failed (no ordinary tokens, or the pass failed)\n", __func__);
        return false;
    }
    s->secs = s->secs_measured = (ggml_time_us() - t0)/1e6;
    std::string kept = "not stored (no k_stats_path; --k-stats chooses where)";
    if (!file.empty()) {
        const std::string err = rq_k_stats_write(file, *s);
        kept = err.empty() ? "stored in " + file + " for later starts"
                           : "not stored (" + err + "): measured again at the next start; --k-stats chooses another place";
    }
    s->source = format("measured on %u pseudo-random tokens in %.1f s, %s", s->n_tokens, s->secs, kept.c_str());
    LLAMA_LOG_WARN("%s: K statistics %s\n", __func__, s->source.c_str());
    return true;
}

void llama_rq_k_stats_for_context(llama_model & model, const llama_context_params & params) {
    if (params.k_center == LLAMA_K_CENTER_OFF || !model.rq_k_center.off.empty()) {
        return;
    }
    // per-layer types may quantise K where type_k does not: measured then too (once per model, and kept)
    const bool layered = params.kv_layer_types && *params.kv_layer_types;
    if (layered || llama_rq_k_needs_center(params.type_k)) {
        llama_rq_measure_k_stats(&model, params.k_stats_path, params.n_threads_batch);
    }
}

const llama_rq_k_center_self * llama_rq_k_stats(const llama_model & model) {
    llama_rq_k_center_self * s = model.rq_k_center.self.get();
    if (!s) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(s->mtx);
    return s->done && !s->data.off.empty() ? s : nullptr;
}

//
// K centring in a cache: each layer's k_scale, k_bias and q_scale
//


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
        ggml_context * ctx = llama_rq_buft_ctx(ctxs, ggml_backend_buffer_get_type(layer.k->buffer), 3*kv.layers.size(), "K centring");
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
