// rq-probe: one measurement program for every llama.cpp build (ours, stock, forks).
//
// Compiled by rotaryquant.eval.builds against each build's own include/llama.h and linked to its own
// libllama, so the same steps run through each build's library: a prompt prefilled in 512-token calls,
// then teacher-forced single-token decode steps (logits of every step written out), or a needle
// haystack evaluated once and each question asked from a saved copy of its state. The API differences
// between builds are compile-time switches, set by the Python side from the build's llama.h:
//   RQ_PROBE_FA_TYPE  llama_context_params.flash_attn_type (newer API) instead of bool flash_attn
//   RQ_PROBE_BATCH4   llama_batch_get_one(tokens, n, pos_0, seq_id) (older API)
//   RQ_PROBE_HAD      ik_llama.cpp's k_cache_hadamard / v_cache_hadamard (-khad, -vhad)
//   RQ_PROBE_RQ       ours: kv_window, k_center, kv_deferred, kv_layer_types, iso_unfused
//   RQ_PROBE_SWA_FULL llama_context_params.swa_full: set false, as the build's own tools do (common's default)
//   RQ_PROBE_KSTATS   ours: k_stats_path (--k-stats PATH keeps measured K statistics there; without it, not kept)
//   RQ_PROBE_SEQ      llama_memory_seq_cp / _rm and kv_unified: --fill independent
//   RQ_PROBE_SEQ_KV   llama_kv_cache_seq_cp / _rm (older API, one cache for every sequence): --fill independent
// Flags not compiled in are refused by name, so a config never runs as something else.
// The build's own log goes to stderr (the KV cache size lines are read from it); one JSON line of
// timings goes to stdout.

#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static const auto t_main = std::chrono::steady_clock::now();

static double since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

[[noreturn]] static void die(const std::string & msg) {
    fprintf(stderr, "rq-probe: error: %s\n", msg.c_str());
    exit(2);
}

static std::vector<std::vector<llama_token>> read_lines(const std::string & path) {
    std::ifstream f(path);
    if (!f) die("cannot read " + path);
    std::vector<std::vector<llama_token>> out;
    std::string line;
    while (std::getline(f, line)) {
        std::istringstream ss(line);
        std::vector<llama_token> row;
        long v;
        while (ss >> v) row.push_back((llama_token) v);
        if (!row.empty()) out.push_back(row);
    }
    return out;
}

static ggml_type type_by_name(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && name == n) return (ggml_type) t;
    }
    die("this build has no cache type '" + name + "'");
}

struct opts {
    std::string mode, model, tokens, out, questions;
    int n_ctx = 0, threads = 2, prefill = 0, steps = 0, answer = 12, repeat = 1;
    std::string ctk = "f16", ctv = "f16";
    bool fa = true, khad = false, vhad = false, independent = false;
    bool rq_no_k_center = false, rq_deferred = false, rq_unfused = false;
    int rq_window = -1;
    std::string rq_layer_types, rq_k_stats;
};

static void usage() {
    fprintf(stderr,
        "usage: rq-probe decode -m MODEL --tokens FILE --prefill N --steps M [--logits OUT] [--repeat R] [context flags]\n"
        "       (--repeat R: the M steps timed R times after one prefill, the state restored before each)\n"
#if defined(RQ_PROBE_SEQ) || defined(RQ_PROBE_SEQ_KV)
        "       (--fill independent: each 512-token call of the prompt attends only to itself, in a sequence of its\n"
        "        own, then joins the decode's: the same cells and positions without the prompt's quadratic attention)\n"
#endif
        "       rq-probe niah   -m MODEL --tokens FILE --questions FILE [--answer K] [context flags]\n"
        "context flags: -c N_CTX -t THREADS -ctk TYPE -ctv TYPE -fa on|off"
#ifdef RQ_PROBE_HAD
        " -khad -vhad"
#endif
#ifdef RQ_PROBE_RQ
        " --kv-window N --no-k-center --kv-deferred --kv-layer-types S --iso-unfused"
#endif
#ifdef RQ_PROBE_KSTATS
        " --k-stats PATH"
#endif
        "\n");
    exit(2);
}

static opts parse(int argc, char ** argv) {
    if (argc < 2) usage();
    opts o;
    o.mode = argv[1];
    if (o.mode != "decode" && o.mode != "niah") usage();
    for (int i = 2; i < argc; i++) {
        std::string a = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) die(a + " needs a value");
            return argv[++i];
        };
        if (a == "-m") o.model = val();
        else if (a == "--tokens") o.tokens = val();
        else if (a == "--questions") o.questions = val();
        else if (a == "--logits") o.out = val();
        else if (a == "-c") o.n_ctx = atoi(val().c_str());
        else if (a == "-t") o.threads = atoi(val().c_str());
        else if (a == "--prefill") o.prefill = atoi(val().c_str());
        else if (a == "--steps") o.steps = atoi(val().c_str());
        else if (a == "--answer") o.answer = atoi(val().c_str());
        else if (a == "--repeat") o.repeat = atoi(val().c_str());
        else if (a == "-ctk") o.ctk = val();
        else if (a == "-ctv") o.ctv = val();
        else if (a == "-fa") { std::string v = val(); o.fa = v == "on" || v == "1"; }
#ifdef RQ_PROBE_HAD
        else if (a == "-khad") o.khad = true;
        else if (a == "-vhad") o.vhad = true;
#endif
#ifdef RQ_PROBE_RQ
        else if (a == "--kv-window") o.rq_window = atoi(val().c_str());
        else if (a == "--no-k-center") o.rq_no_k_center = true;
        else if (a == "--kv-deferred") o.rq_deferred = true;
        else if (a == "--kv-layer-types") o.rq_layer_types = val();
        else if (a == "--iso-unfused") o.rq_unfused = true;
#endif
#ifdef RQ_PROBE_KSTATS
        else if (a == "--k-stats") o.rq_k_stats = val();
#endif
#if defined(RQ_PROBE_SEQ) || defined(RQ_PROBE_SEQ_KV)
        else if (a == "--fill") {
            std::string v = val();
            if (v != "prompt" && v != "independent") die("--fill takes prompt or independent, not " + v);
            o.independent = v == "independent";
        }
#endif
        else die("unknown flag for this build: " + a);
    }
    if (o.model.empty() || o.tokens.empty() || o.n_ctx <= 0) usage();
    if (o.independent && o.mode != "decode") die("--fill is a decode flag: a haystack is always its prompt");
    return o;
}

static llama_batch batch_of(std::vector<llama_token> & toks, size_t at, int n, int pos) {
#ifdef RQ_PROBE_BATCH4
    return llama_batch_get_one(toks.data() + at, n, pos, 0);
#else
    (void) pos;
    return llama_batch_get_one(toks.data() + at, n);
#endif
}

// evaluate toks[at, at+n) in calls of at most 512 tokens from position pos
static void eval(llama_context * ctx, std::vector<llama_token> & toks, size_t at, int n, int pos) {
    for (int done = 0; done < n;) {
        int k = std::min(512, n - done);
        if (n - done - k == 1) k--;  // never a single-token call inside a prompt: that is a decode step
        if (llama_decode(ctx, batch_of(toks, at + done, k, pos + done)) != 0) die("llama_decode failed");
        done += k;
    }
}

#if defined(RQ_PROBE_SEQ) || defined(RQ_PROBE_SEQ_KV)
// the prompt's cells without its quadratic attention: each call evaluated in sequence 1 (empty before it, starting
// at its own positions), then handed to sequence 0 and dropped from 1, so a call attends only to its own tokens
// (the other cells are masked, and ggml's CPU attention skips masked keys). The decode steps that follow see the
// same number of cells at the same positions as after the prompt; the values in them differ.
static void eval_independent(llama_context * ctx, std::vector<llama_token> & toks, int n) {
#ifdef RQ_PROBE_SEQ
    llama_memory_t mem = llama_get_memory(ctx);
#endif
    llama_batch b = llama_batch_init(512, 0, 1);
    for (int done = 0; done < n;) {
        int k = std::min(512, n - done);
        if (n - done - k == 1) k--;
        b.n_tokens = k;
        for (int i = 0; i < k; i++) {
            b.token[i] = toks[done + i];
            b.pos[i] = done + i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 1;
            b.logits[i] = i == k - 1;
        }
        if (llama_decode(ctx, b) != 0) die("llama_decode failed");
#ifdef RQ_PROBE_SEQ
        llama_memory_seq_cp(mem, 1, 0, -1, -1);
        llama_memory_seq_rm(mem, 1, -1, -1);
#else
        llama_kv_cache_seq_cp(ctx, 1, 0, -1, -1);
        llama_kv_cache_seq_rm(ctx, 1, -1, -1);
#endif
        done += k;
    }
    llama_batch_free(b);
}
#endif

static llama_token argmax(const float * p, int n) {
    return (llama_token) (std::max_element(p, p + n) - p);
}

int main(int argc, char ** argv) {
    opts o = parse(argc, argv);
    llama_backend_init();

    auto t0 = std::chrono::steady_clock::now();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(o.model.c_str(), mp);
    if (!model) die("cannot load " + o.model);
    double load_s = since(t0);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = o.n_ctx;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_seq_max = o.independent ? 2 : 1;
#ifdef RQ_PROBE_SEQ
    cp.kv_unified = o.independent;  // both sequences in one stream: a copy between them is a tag, not a move
#endif
    cp.n_threads = cp.n_threads_batch = o.threads;
    cp.type_k = type_by_name(o.ctk);
    cp.type_v = type_by_name(o.ctv);
#ifdef RQ_PROBE_FA_TYPE
    cp.flash_attn_type = o.fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
#else
    cp.flash_attn = o.fa;
#endif
#ifdef RQ_PROBE_SWA_FULL
    cp.swa_full = false;
#endif
#ifdef RQ_PROBE_HAD
    cp.k_cache_hadamard = o.khad;
    cp.v_cache_hadamard = o.vhad;
#endif
#ifdef RQ_PROBE_RQ
    if (o.rq_window >= 0) cp.kv_window = o.rq_window;
    if (o.rq_no_k_center) cp.k_center = LLAMA_K_CENTER_OFF;
    if (o.rq_deferred) cp.kv_deferred = -1;
    if (!o.rq_layer_types.empty()) cp.kv_layer_types = o.rq_layer_types.c_str();
    cp.iso_unfused = o.rq_unfused;
#endif
#ifdef RQ_PROBE_KSTATS
    if (!o.rq_k_stats.empty()) cp.k_stats_path = o.rq_k_stats.c_str();
#endif
    t0 = std::chrono::steady_clock::now();
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create a context with these settings (see the log above)");
    double ctx_s = since(t0);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    auto lines = read_lines(o.tokens);
    if (lines.empty()) die(o.tokens + " holds no tokens");
    std::vector<llama_token> toks = lines[0];

    if (o.mode == "decode") {
        if (o.prefill < 2 || o.steps < 0 || (size_t) (o.prefill + o.steps) > toks.size())
            die("--prefill N (>= 2) and --steps M need N + M tokens in " + o.tokens);
        if (o.prefill + o.steps > o.n_ctx) die("prefill + steps exceed -c");
        if (o.repeat < 1) die("--repeat needs at least 1");
        FILE * lf = o.out.empty() ? nullptr : fopen(o.out.c_str(), "wb");
        if (!o.out.empty() && !lf) die("cannot write " + o.out);
        t0 = std::chrono::steady_clock::now();
#if defined(RQ_PROBE_SEQ) || defined(RQ_PROBE_SEQ_KV)
        if (o.independent) eval_independent(ctx, toks, o.prefill);
        else
#endif
        eval(ctx, toks, 0, o.prefill, 0);
        double prefill_s = since(t0);
        double first_s = since(t_main);
        if (lf) fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), n_vocab, lf);
        // a long prompt's prefill costs minutes; the steps after it, seconds: timing them again from a saved copy
        // of the state gives more samples of the decode speed at that depth for no further prefill
        std::vector<uint8_t> state;
        if (o.repeat > 1) {
            state.resize(llama_state_get_size(ctx));
            state.resize(llama_state_get_data(ctx, state.data(), state.size()));
        }
        std::vector<double> decode_s(o.repeat, 0.0);
        for (int r = 0; r < o.repeat; r++) {
            if (r > 0 && llama_state_set_data(ctx, state.data(), state.size()) != state.size())
                die("cannot restore the state");
            for (int i = 0; i < o.steps; i++) {
                t0 = std::chrono::steady_clock::now();
                if (llama_decode(ctx, batch_of(toks, o.prefill + i, 1, o.prefill + i)) != 0) die("llama_decode failed");
                decode_s[r] += since(t0);
                if (lf && r == 0) fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), n_vocab, lf);
            }
        }
        if (lf && fclose(lf) != 0) die("cannot write " + o.out);
        std::string reps;
        for (double d : decode_s) reps += (reps.empty() ? "" : ", ") + std::to_string(d);
        printf("{\"load_s\": %.4f, \"ctx_s\": %.4f, \"prefill_s\": %.4f, \"decode_s\": %.4f, \"first_token_s\": %.4f, "
               "\"n_vocab\": %d, \"decode_s_repeats\": [%s]}\n", load_s, ctx_s, prefill_s, decode_s[0], first_s, n_vocab,
               reps.c_str());
    } else {
        if (o.questions.empty()) die("niah needs --questions");
        auto questions = read_lines(o.questions);
        const int n_hay = (int) toks.size();
        t0 = std::chrono::steady_clock::now();
        eval(ctx, toks, 0, n_hay, 0);
        double prefill_s = since(t0);
        std::vector<uint8_t> state(llama_state_get_size(ctx));
        state.resize(llama_state_get_data(ctx, state.data(), state.size()));
        for (auto & q : questions) {
            if (llama_state_set_data(ctx, state.data(), state.size()) != state.size()) die("cannot restore the state");
            if (n_hay + (int) q.size() + o.answer > o.n_ctx) die("haystack + question + answer exceed -c");
            eval(ctx, q, 0, (int) q.size(), n_hay);
            std::vector<llama_token> ans;
            int pos = n_hay + (int) q.size();
            for (int k = 0; k < o.answer; k++) {
                ans.push_back(argmax(llama_get_logits_ith(ctx, -1), n_vocab));
                if (k + 1 == o.answer) break;
                if (llama_decode(ctx, batch_of(ans, ans.size() - 1, 1, pos++)) != 0) die("llama_decode failed");
            }
            for (size_t k = 0; k < ans.size(); k++) printf(k ? " %d" : "%d", ans[k]);
            printf("\n");
        }
        printf("{\"load_s\": %.4f, \"ctx_s\": %.4f, \"prefill_s\": %.4f, \"n_vocab\": %d}\n", load_s, ctx_s,
               prefill_s, n_vocab);
    }
    llama_free(ctx);  // the model's memory goes with the process (its free function's name differs by build)
    return 0;
}
