// RotaryQuant: common_rq_params_from_env (declared in common/common.h), compiled into upstream's common
// library; settings a tool has no flags for come from the environment.

#include "common.h"
#include "ggml-rq.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>

const char * common_rq_k_stats_path(const std::string & arg) {
    if (arg == "none") {
        return "";
    }
    if (!arg.empty()) {
        return arg.c_str(); // as kv_layer_types: valid while the common_params that hold it
    }
    static const std::string dflt = [] {
        try {
            return fs_path_to_utf8(fs_get_cache_directory() / "rq-k-stats");
        } catch (const std::exception &) {
            return std::string(); // no home or cache directory: measured at every start
        }
    }();
    return dflt.c_str();
}

void common_rq_params_from_env(llama_context_params & cparams) {
    if (!cparams.k_stats_path) {
        cparams.k_stats_path = common_rq_k_stats_path(""); // tools without --k-stats (llama-bench) keep them too
    }
    const auto env = [](const char * name) -> std::string {
        const char * v = getenv(name);
        return v ? v : "";
    };
    const std::string unf = env("LLAMA_ISOQUANT_UNFUSED");
    if (!unf.empty() && unf != "0") {
        cparams.iso_unfused = true;
    }
    const std::string kc = env("LLAMA_K_CENTER");
    if (!kc.empty() && cparams.k_center == LLAMA_K_CENTER_AUTO) {
        if      (kc == "0" || kc == "off")   cparams.k_center = LLAMA_K_CENTER_OFF;
        else if (kc == "1" || kc == "on")    cparams.k_center = LLAMA_K_CENTER_AUTO;
        else if (kc == "2" || kc == "force") cparams.k_center = LLAMA_K_CENTER_FORCE;
        else throw std::invalid_argument("LLAMA_K_CENTER=" + kc + " is not one of 0, 1, force");
    }
    const std::string dfr = env("LLAMA_KV_DEFERRED");
    if (!dfr.empty() && cparams.kv_deferred == 0) {
        char * end = nullptr;
        const long long n = strtoll(dfr.c_str(), &end, 10);
        if      (dfr == "on" || (*end == '\0' && n == 1))  cparams.kv_deferred = -1;
        else if (dfr == "off" || (*end == '\0' && n == 0)) cparams.kv_deferred = 0;
        else if (*end == '\0' && n > 1)                    cparams.kv_deferred = n;
        else throw std::invalid_argument("LLAMA_KV_DEFERRED=" + dfr + " is not 0, 1 or a budget in cells (> 1)");
    }
    const std::string win = env("LLAMA_KV_WINDOW");
    if (!win.empty() && cparams.kv_window < 0) {
        char * end = nullptr;
        const long n = strtol(win.c_str(), &end, 10);
        if (*end != '\0' || n < 0 || n > 4096) {
            throw std::invalid_argument("LLAMA_KV_WINDOW=" + win + " is not a window in positions (0 to 4096)");
        }
        cparams.kv_window = (int32_t) n;
    }
    static const std::string layers = env("LLAMA_KV_LAYER_TYPES"); // outlives the params
    cparams.kv_layer_types = cparams.kv_layer_types || layers.empty() ? cparams.kv_layer_types : layers.c_str();
    // research switches (ggml-rq.h), process-wide: the variant changes the packed format
    static const std::map<std::string, ggml_rq_iso_variant> variants = {
        {"v3", GGML_RQ_ISO_V3}, {"v2", GGML_RQ_ISO_V2}, {"v1", GGML_RQ_ISO_V1}, {"none", GGML_RQ_ISO_NONE} };
    const std::string var = env("GGML_ISOQUANT_VARIANT");
    if (!var.empty()) {
        if (variants.count(var) == 0) {
            throw std::invalid_argument("GGML_ISOQUANT_VARIANT=" + var + " is not one of v3, v2, v1, none");
        }
        ggml_rq_iso_set_variant(variants.at(var));
    }
    const std::string skip = env("GGML_ISOQUANT_SKIP_INVERSE");
    if (!skip.empty()) {
        ggml_rq_iso_set_skip_inverse(skip != "0");
    }
    // the CPU's AVX-512 IsoQuant attention kernels (VNNI scores, bf16 V) or the float ones, for A/B benchmarks
    const std::string avx = env("GGML_RQ_CPU_AVX512");
    if (!avx.empty()) {
        ggml_rq_cpu_set_avx512(avx != "0");
    }
}
