// RotaryQuant CPU kernels, internal: what the portable kernels (rq-cpu.c), the fused attention's driver
// (rq-fa.c) and the ISA variants (arch/x86, arch/arm) share. The layout is ggml-cpu's: each kernel has a
// portable twin named *_generic, an arch/ file defines the kernel itself where it has SIMD for it, and
// rq-arch-fallback.h renames the twin to the kernel elsewhere.
#pragma once

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-impl.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "ggml-quants.h"
#include "ggml-rq.h"
#include "rq-cpu.h"
#include "quants.h"
#include "vec.h"

#include <math.h>
#include <string.h>

// the IsoQuant helpers take the index width (bits) and the block width (qk = 128 or 64) as arguments; forced
// inlining with constants makes every lookup as tight as a width-specific kernel (measured: 30 % slower without)
#if defined(__GNUC__)
#define RQ_INLINE static inline __attribute__((always_inline))
#else
#define RQ_INLINE static inline
#endif

// IsoQuant blocks of any width: d (fp16) then qk*bits/8 bytes of packed indices
RQ_INLINE const uint8_t * iso_block(const void * x, int64_t ib, int bits, int qk) {
    return (const uint8_t *) x + ib*(int64_t) (sizeof(ggml_half) + qk*bits/8);
}

RQ_INLINE float iso_block_d(const uint8_t * blk) {
    ggml_half d;
    memcpy(&d, blk, sizeof(d));
    return GGML_CPU_FP16_TO_FP32(d);
}

// the bits*8-bit word of group g of a block's packed indices (ggml_rq_iso_word) in one 4-byte load: at the group's
// first byte wherever the block has a byte after the group (the top byte is never shifted into an index: lanes
// read bits 0..8*bits-1), and for the last group of a 3-bit block, which may end the buffer, one byte earlier and
// shifted down (a byte loop there cost the 3-bit unpack 13 instructions per 8 values and kept loops rolled)
RQ_INLINE uint32_t iso_word(const uint8_t * qs, int g, int bits, int ng) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t w;
    if (bits == 4 || g < ng - 1) {
        memcpy(&w, qs + bits*g, sizeof(w));
        return w;
    }
    memcpy(&w, qs + bits*g - 1, sizeof(w));
    return w >> 8;
#else
    GGML_UNUSED(ng);
    return ggml_rq_iso_word(qs, g, bits);
#endif
}

// ---------------------------------------------------------------------------------------------
// fused attention: the driver (rq-fa.c) and the kernels it calls through struct rq_fa_kernels

#define RQ_FA_TILE 8   // query rows of one K/V head processed together
#define RQ_FA_KB   16  // keys per online-softmax update
// Visible keys per chunk: each chunk runs its own online softmax and the chunks are folded in order (iso_fa_fold).
// A fixed count of a row's visible keys, so chunk boundaries do not depend on threads, batch or cache layout, and
// single-token decode can hand a tile's chunks to several threads (ggml_rq_fa_iso_split) with the same bits.
#define RQ_FA_CHUNK 1024
// The largest K and V head size the fused kernel takes (buffers are sized by it; larger heads take upstream's path:
// ggml_rq_fa_iso_takes). 576: DeepSeek's MLA keys.
#define RQ_FA_DMAX 576

// The online softmax's weights (exps of scores less the row's max) are 0 below RQ_FA_FTZ. Such a key weighs under
// 2^-115 next to the max's 1, far under any float sum's resolution, but its exp (and its products with V) would be a
// denormal, and x86 takes a microcode assist for each one: with sharp scores (most keys > 87 below the max, as a
// model's attention at long context) the op ran 1.3x slower. Upstream's CUDA FA flushes the same way, from -20
// (SOFTMAX_FTZ_THRESHOLD). NaN stays NaN.
#define RQ_FA_FTZ (-80.0f)

static inline float iso_expf_ftz(float x) {
    return x < RQ_FA_FTZ ? 0.0f : expf(x);
}

// what the kernels need of one op, fixed for its duration
struct rq_fa_op {
    int     k_bits, k_qk;   // K's index and block width; k_bits 0: K is another type (its own vec_dot scores it)
    int     v_bits, v_qk;
    int64_t dk, dv;
};

#if defined(_MSC_VER) && !defined(__clang__)
#define RQ_ALIGN64 __declspec(align(64))
#else
#define RQ_ALIGN64 __attribute__((aligned(64)))
#endif

// the query tile in the form the score kernel reads it (filled by q_tile from the rows as converted for K's vec_dot)
struct rq_fa_qtile {
    RQ_ALIGN64 float  qi[RQ_FA_DMAX*RQ_FA_TILE];                          // AVX2: group-interleaved rows
    RQ_ALIGN64 int8_t q8[RQ_FA_DMAX*RQ_FA_TILE];                          // AVX-512: int8 rows
    float         sc[RQ_FA_DMAX/QK_ISO][RQ_FA_TILE];                      // AVX-512: per-block row scales, biases
    int32_t       bias[RQ_FA_DMAX/QK_ISO][RQ_FA_TILE];
    const float * q;                                                      // portable: the rows themselves
    int64_t       q_stride;
};

// One ISA's fused-attention kernels. Scores and weights are [key][row] with RQ_FA_TILE lanes per key; rows t >= T
// hold finite values that no row reads. Per row, a kernel's operations and their order never depend on T or on
// which other rows share the tile (batch invariance).
struct rq_fa_kernels {
    void (*q_tile)(const struct rq_fa_op * op, int T, const float * q, int64_t q_stride, struct rq_fa_qtile * qt);
    // raw[us[j]][t] = <row t, key xs[j]> for nk packed IsoQuant keys
    void (*score)(const struct rq_fa_op * op, const struct rq_fa_qtile * qt, int T, int nk,
                  const uint8_t * const * xs, const int * us, float (*raw)[RQ_FA_TILE]);
    // the block's online-softmax update: raw <- scale (or softcap tanh) + slope*mask per key and row; a row whose max
    // rises takes it (M[t]) and ms[t] = exp(old max - new), 0 on its first block, else ms[t] = 1; S[t] <- S[t]*ms[t] +
    // the sum of its weights, raw <- the weights exp(raw - M[t]). The caller rescales its V rows by ms.
    void (*softmax)(int T, int nu, float (*raw)[RQ_FA_TILE], const float * mk, const float * slope, float scale,
                    float softcap, float * M, float * S, float * ms);
    // vkq[t] += sum_u w[u][t] * value u (rotated domain) over nu packed IsoQuant values
    void (*mad)(const struct rq_fa_op * op, int T, int nu, float * vkq, int64_t vkq_stride,
                const uint8_t * const * vx, const float (*w)[RQ_FA_TILE]);
    int counter;   // the counter bumped once per call that runs them (enum ggml_rq_counter), or -1
};

// the portable kernels (rq-cpu.c), and the best ones this CPU runs (chosen once by ggml_rq_cpu_init)
extern const struct rq_fa_kernels ggml_rq_fa_kernels_generic;
const struct rq_fa_kernels * ggml_rq_fa_kernels(void);

// each arch's choice, called once by ggml_rq_cpu_init: its best kernels, and the best without AVX-512
void ggml_rq_fa_kernels_init(const struct rq_fa_kernels ** best, const struct rq_fa_kernels ** base);
void ggml_rq_fa_kernels_init_generic(const struct rq_fa_kernels ** best, const struct rq_fa_kernels ** base);

// codebook values (unscaled) and block norms of one packed row, and the dot and multiply-add on such a row: the
// portable attention's key and value steps
void ggml_rq_iso_unpack(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk);
float ggml_rq_iso_dot_unpacked(int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, const float * GGML_RESTRICT q, int qk);
void ggml_rq_iso_mad_unpacked(int n, float * GGML_RESTRICT acc, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, float v, int qk);

// the portable twins
void ggml_vec_dot_isoquant3_0_isoq_q_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                             const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_isoquant4_0_isoq_q_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                             const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_isoquant3_64_isoq_q64_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                                const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_isoquant4_64_isoq_q64_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                                const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_rq_iso_unpack_generic(int n, const void * GGML_RESTRICT x, float * GGML_RESTRICT c, float * GGML_RESTRICT d, int bits, int qk);
float ggml_rq_iso_dot_unpacked_generic(int n, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, const float * GGML_RESTRICT q, int qk);
void ggml_rq_iso_mad_unpacked_generic(int n, float * GGML_RESTRICT acc, const float * GGML_RESTRICT c, const float * GGML_RESTRICT d, float v, int qk);
void quantize_row_q8_itq_generic(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void ggml_rq_itq3_codes_generic(const void * GGML_RESTRICT x, uint8_t * GGML_RESTRICT dst);
void ggml_vec_dot_itq3_s_q8_itq_generic(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                        const void * GGML_RESTRICT vy, size_t by, int nrc);

// the dispatch of a kernel template over tile height, index width and block width, all as constants
#define RQ_ISO_T(F, B, QK, ...) switch (T) {                                    \
        case 1: F(1, __VA_ARGS__, B, QK); break;                                 \
        case 2: F(2, __VA_ARGS__, B, QK); break;                                 \
        case 3: F(3, __VA_ARGS__, B, QK); break;                                 \
        case 4: F(4, __VA_ARGS__, B, QK); break;                                 \
        case 5: F(5, __VA_ARGS__, B, QK); break;                                 \
        case 6: F(6, __VA_ARGS__, B, QK); break;                                 \
        case 7: F(7, __VA_ARGS__, B, QK); break;                                 \
        default: F(RQ_FA_TILE, __VA_ARGS__, B, QK); break; }
#define RQ_ISO_DISPATCH(F, ...)                                                  \
    static_assert(RQ_FA_TILE == 8, "the dispatch covers tile heights 1..8");    \
    if (qk == QK_ISO) {                                                          \
        if (bits == 3) { RQ_ISO_T(F, 3, QK_ISO, __VA_ARGS__) }                   \
        else           { RQ_ISO_T(F, 4, QK_ISO, __VA_ARGS__) }                   \
    } else {                                                                     \
        if (bits == 3) { RQ_ISO_T(F, 3, QK_ISO64, __VA_ARGS__) }                 \
        else           { RQ_ISO_T(F, 4, QK_ISO64, __VA_ARGS__) }                 \
    }

#include "rq-arch-fallback.h"

#if defined(RQ_ARCH_X86) && defined(__AVX2__)
extern const struct rq_fa_kernels ggml_rq_fa_kernels_avx2;
#if defined(__GNUC__)
// AVX-512 VNNI/BF16 kernels, compiled function by function with target attributes (the build stays x86-64-v3)
#define RQ_HAVE_AVX512_FA 1
extern const struct rq_fa_kernels ggml_rq_fa_kernels_avx512;
bool ggml_rq_fa_avx512_init(void); // whether this CPU and OS run them; builds their tables
#endif
#endif
