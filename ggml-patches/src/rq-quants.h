// RotaryQuant reference (de)quantisers, part of ggml-base. Included by ggml-quants.h.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

GGML_API void quantize_row_isoquant3_0_ref(const float * GGML_RESTRICT x, block_isoquant3_0 * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_isoquant3_0(const block_isoquant3_0 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_isoquant3_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

GGML_API void quantize_row_isoquant4_0_ref(const float * GGML_RESTRICT x, block_isoquant4_0 * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_isoquant4_0(const block_isoquant4_0 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_isoquant4_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

GGML_API void quantize_row_isoquant3_64_ref(const float * GGML_RESTRICT x, block_isoquant3_64 * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_isoquant3_64(const block_isoquant3_64 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_isoquant3_64(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

GGML_API void quantize_row_isoquant4_64_ref(const float * GGML_RESTRICT x, block_isoquant4_64 * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_isoquant4_64(const block_isoquant4_64 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_isoquant4_64(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// IsoQuant packing, both index widths: group g of 8 indices is the `bits`-byte little-endian word at qs[bits*g],
// index k its bits bits*k .. bits*k + bits-1
static inline uint32_t ggml_rq_iso_word(const uint8_t * qs, int g, int bits) {
    uint32_t w = 0;
    for (int b = 0; b < bits; ++b) {
        w |= (uint32_t) qs[bits*g + b] << (8*b);
    }
    return w;
}

GGML_API void quantize_row_isoq_q_ref(const float * GGML_RESTRICT x, block_isoq_q * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_isoq_q64_ref(const float * GGML_RESTRICT x, block_isoq_q64 * GGML_RESTRICT y, int64_t k);

GGML_API void quantize_row_itq3_s_ref(const float * GGML_RESTRICT x, block_itq3_s * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_itq3_s(const block_itq3_s * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_itq3_s(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

GGML_API void quantize_row_q8_itq_ref(const float * GGML_RESTRICT x, block_q8_K * GGML_RESTRICT y, int64_t k);
// one rotated 256-block of activations to Q8_ITQ: block_q8_K's layout with 7-bit codes (|q| <= RQ_Q7_MAX)
#define RQ_Q7_MAX 63
GGML_API void ggml_rq_quantize_q7_K(const float * GGML_RESTRICT t, block_q8_K * GGML_RESTRICT y);

// the Walsh-Hadamard transform of n = 2^k values in place, then v *= scale (1/sqrt(n): its own inverse);
// isoquant.c (n = 128, 64) and itq3.c (n = 256). The numpy references and rq_wht_warp (CUDA) keep this order.
static inline void ggml_rq_wht(float * GGML_RESTRICT v, const int n, const float scale) {
    for (int h = 1; h < n; h <<= 1) {
        for (int i = 0; i < n; i += 2*h) {
            for (int j = i; j < i + h; ++j) {
                const float a = v[j];
                const float b = v[j + h];
                v[j]     = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (int i = 0; i < n; ++i) {
        v[i] *= scale;
    }
}

// the normalised 256-point Walsh-Hadamard transform in place (its own inverse)
GGML_API void ggml_rq_fwht256(float * GGML_RESTRICT x);

// ITQ3_S's rotation of one 256-block: t = FWHT256(S x) (activations for Q8_ITQ, weights before coding)
GGML_API void ggml_rq_itq3_rotate(const float * GGML_RESTRICT x, float * GGML_RESTRICT t);

#ifdef __cplusplus
}
#endif
