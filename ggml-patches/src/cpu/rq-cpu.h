// RotaryQuant CPU kernels (part of ggml-cpu): the CPU traits of our types and the flash-attention
// helpers that keep IsoQuant (ISOQUANT3_0/4_0) values in the rotated domain.
#pragma once

#include "ggml.h"
#include "ggml-rq.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void quantize_row_isoquant3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_isoquant4_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_isoq_q     (const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_isoquant3_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_isoquant4_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_isoq_q64    (const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// sum_b ||x_b|| * <c[idx_b], (R q)_b>: the query arrives rotated (ISOQ_Q), keys stay packed
void ggml_vec_dot_isoquant3_0_isoq_q(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                     const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_isoquant4_0_isoq_q(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                     const void * GGML_RESTRICT vy, size_t by, int nrc);
// the same for the 64-wide types against ISOQ_Q64
void ggml_vec_dot_isoquant3_64_isoq_q64(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                        const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_isoquant4_64_isoq_q64(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                        const void * GGML_RESTRICT vy, size_t by, int nrc);

// acc <- R^T acc for every 128-value block (once per output row), unless the ablation switch is set
void ggml_rq_iso_unrotate(int n, float * acc);
// the same for qk-value blocks (128 or 64)
void ggml_rq_iso_unrotate_qk(int n, float * acc, int qk);

void quantize_row_itq3_s(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_q8_itq (const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
// sum_b dx_b * (d_b * <grid[q_b], qx_b> + m_b * sum(qx_b)): both operands in the rotated domain
void ggml_vec_dot_itq3_s_q8_itq(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc);
// one block_itq3_s's codes as grid[q] + 127 in [0, 254], element order (the tiled matmul's weight tile, rq-tiled.h)
void ggml_rq_itq3_codes(const void * GGML_RESTRICT x, uint8_t * GGML_RESTRICT dst);

struct ggml_compute_params;
// Flash attention for query rows [ir0, ir1) with an IsoQuant (3- or 4-bit, 128- or 64-wide) V cache (any K type): keys outer, rows
// inner, so each packed K/V row is unpacked once for all query rows of its head (GQA heads, prompt
// tokens). Per row, the operations and their order do not depend on the grouping: batch-invariant.
void ggml_rq_fa_iso_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst, int64_t ir0, int64_t ir1);
// Single-token decode with fewer tiles (K/V heads) than threads: the threads split each tile's visible keys in
// chunks of a fixed count and fold the chunks in order, the same bits as ggml_rq_fa_iso_rows. Called by every
// thread; false (no thread did anything) where it does not apply.
bool ggml_rq_fa_iso_split(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// whether ggml_rq_fa_iso_rows takes this FLASH_ATTN_EXT (IsoQuant V, head sizes it has room for); else upstream's path
bool ggml_rq_fa_iso_takes(const struct ggml_tensor * dst);

// picks the fused attention's kernels for this CPU, once (ggml_cpu_init)
void ggml_rq_cpu_init(void);

// counts flash-attention ops that touch IsoQuant K/V (fused vs reference path)
void ggml_rq_fa_count(enum ggml_type type_k, enum ggml_type type_v, bool use_ref);

#ifdef __cplusplus
}
#endif
