// ITQ3_S in ggml-cpu's tiled matmul (tiled/tiled.cpp includes this after tiled-kernel.h). Prompt-sized
// batches then take the same 16x16 microkernels as the K-quants, with Q4_K's constants (unsigned codes, a
// min): the codes are unpacked once per tile as u = grid[q] + 127 in [0, 254], and the activations are
// Q8_ITQ's 7-bit codes (|q| <= 63, rq-quants.h), so maddubs pairs stay below 2*254*63 < 32767. One scale of
// 1 per 32; the block offset rides as the min. The activations arrive rotated (the driver converts src1
// with the vec_dot_type's from_float), so as in the vec_dot
//     sum_i (d grid[q_i] + m) y_i = d sum_i u_i y_i - (127 d - m) sum_i y_i = d0 raw - dmin bsum,
// with exact integer sums; only the float rounding order differs from the vec_dot.
#pragma once

#include "ggml-rq/cpu/rq-cpu.h"

static void tiled_unpack_src0(const block_itq3_s * rows, int64_t row_stride, int n_rows, tiled_tile_src0 * tile, int num_k) {
    GGML_ASSERT(n_rows <= TILED_TILE_ROWS);
    constexpr int NB = TILED_TILE_K / 32;
    static_assert(QK_ITQ == TILED_TILE_K, "one ITQ3_S block per tiled K slab");

    const int qk_stride = num_k * TILED_TILE_K;
    const int nb_stride = NB * num_k;
    for (int slab = 0; slab < num_k; slab++) {
        for (int r = 0; r < n_rows; r++) {
            const int d_off = slab * TILED_MICRO + r;
            const int s_off = r * nb_stride + slab * NB;
            const block_itq3_s & x = rows[r * row_stride + slab];
            const float d = ggml_fp16_to_fp32(x.d);
            tile->d[d_off]    = d;
            tile->dmin[d_off] = 127.0f * d - ggml_fp16_to_fp32(x.m);
            for (int s = 0; s < NB; s++) {
                tile->scales[s_off + s] = 1;
                tile->mins[s_off + s]   = 1;
            }
            ggml_rq_itq3_codes(&x, &tile->q[r * qk_stride + slab * TILED_TILE_K]);
        }
    }
}
