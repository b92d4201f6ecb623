#pragma once

// RotaryQuant additions to ggml: the ISOQUANT3_0/ISOQUANT4_0 KV-cache types, the ITQ3_S weight type,
// counters that show which attention path ran, and research switches.
// Lives in this repo (ggml-patches/include) and is linked into ggml/include by the build.

#include "ggml.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// bumped whenever the packed formats or this API change
#define GGML_RQ_VERSION 7   // 2: GGML_TYPE_ISOQUANT4_0; 3: deferred prefill switch and counters;
                            // 4: the 64-wide types ISOQUANT3_64/ISOQUANT4_64 (ISOQ_Q64), *_qk rotation/codebook;
                            // 5: ggml_rq_quantize_itq3_s_xtx (ITQ3_S LDLQ with calibration statistics);
                            // 6: the unfused/K-centring/deferred switches and their counters moved to llama's
                            //    context params; ggml_rq_tensor_offset
                            // 7: ggml_rq_flash_attn_ext_set_exact (exact rows of a recent window)

GGML_API int ggml_rq_version(void);

// the IsoQuant KV-cache types: the same rotation and norm-preserving scale, a 3- or 4-bit codebook, on
// 128-value blocks (ISOQUANT3_0/4_0) or 64-value blocks (ISOQUANT3_64/4_64, for head size 64)
static inline bool ggml_rq_type_is_iso(enum ggml_type type) {
    return type == GGML_TYPE_ISOQUANT3_0  || type == GGML_TYPE_ISOQUANT4_0 ||
           type == GGML_TYPE_ISOQUANT3_64 || type == GGML_TYPE_ISOQUANT4_64;
}

// index width of an IsoQuant type (3 or 4), 0 for any other type
static inline int ggml_rq_iso_bits(enum ggml_type type) {
    return type == GGML_TYPE_ISOQUANT3_0 || type == GGML_TYPE_ISOQUANT3_64 ? 3 :
           type == GGML_TYPE_ISOQUANT4_0 || type == GGML_TYPE_ISOQUANT4_64 ? 4 : 0;
}

// block width of an IsoQuant type (128 or 64; its rotation's width), 0 for any other type
static inline int ggml_rq_iso_qk(enum ggml_type type) {
    return type == GGML_TYPE_ISOQUANT3_0  || type == GGML_TYPE_ISOQUANT4_0  ? 128 :
           type == GGML_TYPE_ISOQUANT3_64 || type == GGML_TYPE_ISOQUANT4_64 ?  64 : 0;
}

// the IsoQuant type of `bits`-bit indices on `qk`-value blocks (GGML_TYPE_COUNT if there is none)
static inline enum ggml_type ggml_rq_iso_type(int bits, int qk) {
    if (qk == 128) {
        return bits == 3 ? GGML_TYPE_ISOQUANT3_0 : bits == 4 ? GGML_TYPE_ISOQUANT4_0 : GGML_TYPE_COUNT;
    }
    if (qk == 64) {
        return bits == 3 ? GGML_TYPE_ISOQUANT3_64 : bits == 4 ? GGML_TYPE_ISOQUANT4_64 : GGML_TYPE_COUNT;
    }
    return GGML_TYPE_COUNT;
}

// counters (relaxed atomics, process-wide: they count what the kernels did, whoever ran them; llama's per-context
// figures are llama_rq_get_kv_stats); "IsoQuant" = all four IsoQuant types together
enum ggml_rq_counter {
    GGML_RQ_ISO_DEQUANT_ROWS = 0, // IsoQuant blocks (128 or 64 values) turned back into floats, by anyone
    GGML_RQ_ISO_FUSED_CALLS,      // flash-attention ops that read IsoQuant K/V in the rotated domain
    GGML_RQ_ISO_FALLBACK_CALLS,   // flash-attention ops with IsoQuant K/V that took the generic path
    GGML_RQ_ISO_QUANT_ROWS,       // IsoQuant blocks written (quantised)
    GGML_RQ_ISO_AVX512_CALLS,     // a thread's share of a fused CPU op whose keys AVX-512 VNNI scored (ggml_rq_cpu_set_avx512)
    GGML_RQ_ISO_SPLIT_CALLS,      // fused CPU decode ops whose threads split the keys of a K/V head (fewer heads than threads)
    GGML_RQ_COUNTER_COUNT,
};

GGML_API uint64_t     ggml_rq_counter_get (enum ggml_rq_counter c);
GGML_API void         ggml_rq_counter_add (enum ggml_rq_counter c, uint64_t n);
GGML_API void         ggml_rq_counters_reset(void);
GGML_API const char * ggml_rq_counter_name(enum ggml_rq_counter c);

// struct ggml_tensor as this library was compiled: offsetof(struct ggml_tensor, <field>) for a field name, its
// sizeof for "sizeof", SIZE_MAX for an unknown name. ctypes mirrors (rotaryquant.bindings.capture) check theirs
// against it, so that a change of the struct upstream fails loudly instead of reading the wrong bytes.
GGML_API size_t ggml_rq_tensor_offset(const char * field);

// Exact rows for some keys of a flash attention whose V (and possibly K) is IsoQuant: k_x/v_x are F16
// [n_embd_k_gqa / n_embd_v_gqa, n_rows] in the cache's own domain (what SET_ROWS quantises: K centred, not rotated),
// rows is I32 [n_kv, n_stream]: the row of k_x/v_x that stands in for that cell's packed K and V, -1 for none. With
// until (I32 [n_kv, n_stream]) and q_pos (I32 [n_q, n_stream], each query's position) a query uses a cell's row only
// if q_pos <= until (a window of recent positions); without them, always. An exact key is scored with the op's q as
// given and its value accumulated outside the rotated domain, added after the one inverse rotation. Sets src[5..9] of
// fa; the CPU kernel reads them, other backends must refuse such an op.
GGML_API void ggml_rq_flash_attn_ext_set_exact(struct ggml_tensor * fa, struct ggml_tensor * k_x,
                                              struct ggml_tensor * v_x, struct ggml_tensor * rows,
                                              struct ggml_tensor * until, struct ggml_tensor * q_pos);

// The unfused path, K centring and deferred prefill are settings of a llama context (llama_context_params:
// iso_unfused, k_center, kv_deferred), not of this library.

// research switches (ablations of the paper's Table 8; not user options), process-wide because the variant changes
// the packed format: quantise and attend with the same setting. This library reads no environment: llama.cpp's
// tools map GGML_ISOQUANT_VARIANT=v3|v2|v1|none and GGML_ISOQUANT_SKIP_INVERSE=1 onto these (common).
enum ggml_rq_iso_variant {
    GGML_RQ_ISO_V3   = 0, // WHT-128 then SO(4) blocks (q_L v conj(q_R)) - the type as designed
    GGML_RQ_ISO_V2   = 1, // SO(4) blocks only, no WHT
    GGML_RQ_ISO_V1   = 2, // WHT then single-quaternion conjugation q v conj(q) (SO(3): leaves an axis)
    GGML_RQ_ISO_NONE = 3, // no rotation (normalise + codebook only)
};
GGML_API void ggml_rq_iso_set_variant(enum ggml_rq_iso_variant v);
GGML_API enum ggml_rq_iso_variant ggml_rq_iso_get_variant(void);
GGML_API void ggml_rq_iso_set_skip_inverse(bool skip); // fused FA leaves the output rotated (wrong on purpose)
GGML_API bool ggml_rq_iso_get_skip_inverse(void);
// Flash attention on the CPU scores ISOQUANT3_0/4_0 keys in integers with AVX-512 VNNI where the CPU has it (an int8
// query and codebook: docs/cpu-paths.md), else with the float kernel. On by default; off for A/B benchmarks and for
// tests of the float kernel on such CPUs.
GGML_API void ggml_rq_cpu_set_avx512(bool allow);
GGML_API bool ggml_rq_cpu_get_avx512(void);
// Single-token decode with fewer K/V heads than threads splits each head's keys across the threads (the same bits as
// one thread: docs/isoquant-design.md). On by default; off only to time the row split it replaces (bench-rq-attn).
GGML_API void ggml_rq_cpu_set_split(bool allow);
GGML_API bool ggml_rq_cpu_get_split(void);

// R and R^T of the current variant on one 128-value block (in place allowed)
GGML_API void ggml_rq_iso_rotate    (const float * x, float * y);
GGML_API void ggml_rq_iso_rotate_inv(const float * y, float * x);
// the same on one qk-value block, qk = 128 or 64 (the 64-wide types' rotation)
GGML_API void ggml_rq_iso_rotate_qk    (const float * x, float * y, int qk);
GGML_API void ggml_rq_iso_rotate_inv_qk(const float * y, float * x, int qk);

// k values (a multiple of the type's block) of IsoQuant type `type` quantised and dequantised into y, as a cache
// would store and read them, without counting rows: what a measurement of the quantiser's error uses, so that the
// counters still tell which attention path ran
GGML_API void ggml_rq_iso_roundtrip(enum ggml_type type, const float * x, float * y, int64_t k);

// the 3-bit Lloyd-Max codebook for a coordinate of a rotated unit 128-vector
GGML_API const float * ggml_rq_iso_codebook(void);
// the codebook of `bits`-bit indices (3: 8 levels, ISOQUANT3_0; 4: 16 levels, ISOQUANT4_0)
GGML_API const float * ggml_rq_iso_codebook_bits(int bits);
// the codebook of `bits`-bit indices on qk-value blocks (qk = 64: ISOQUANT3_64/4_64, a wider marginal)
GGML_API const float * ggml_rq_iso_codebook_qk(int bits, int qk);

// ITQ3_S with second-order calibration (LDLQ, docs/itq3-design.md §5.3): quantise nrow rows of n_per_row
// (a multiple of 256) values like quantize_itq3_s, with codes chosen by error feedback against the inputs' Gram
// matrices. xtx: for each of the n_per_row/256 column blocks, sum_t x_t x_t^T (256x256, row-major, the original
// unrotated domain, raw sums), blocks contiguous; NULL gives the plain quantiser. Deterministic, and the bytes of a
// row do not depend on the other rows of the call. Returns the bytes written.
GGML_API size_t ggml_rq_quantize_itq3_s_xtx(const float * src, void * dst, int64_t nrow, int64_t n_per_row,
                                            const float * xtx);

#ifdef __cplusplus
}
#endif
