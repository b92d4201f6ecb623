// RotaryQuant on CUDA: the entry points the ggml-cuda hooks of patch 0008 call. Everything else
// (kernels, launch decisions, counters) lives in the .cu files beside this header.
//
//   ISOQUANT3_0, ISOQUANT4_0 (128-value blocks), ISOQUANT3_64, ISOQUANT4_64 (64-value blocks)
//                SET_ROWS / CPY F32->ISO (bit-exact device quantiser), CPY ISO->F32/F16, GET_ROWS,
//                to_fp16/fp32/bf16 (+ _nc) with the inverse rotation, fused FLASH_ATTN_EXT (fattn-iso.cu)
//   ITQ3_S       to_fp16/fp32/bf16 (+ _nc) with the inverse FWHT, GET_ROWS, MUL_MAT(_ID) at small batch
//                (activations rotated once, int8 dot against the codes); larger batches: to_fp16 + cuBLAS
#pragma once

#include "ggml-cuda/common.cuh"
#include "ggml-cuda/convert.cuh"
#include "ggml-rq.h"

// op support for anything that touches our types: 1 supported, 0 not, -1 not ours (ask upstream)
int ggml_rq_cuda_supports_op(const ggml_tensor * op);

// dequantisers for the upstream getters (convert.cu): nullptr for a type not ours (ask upstream). Each
// call adds the IsoQuant blocks it reconstructs to GGML_RQ_ISO_DEQUANT_ROWS (host side).
to_fp16_cuda_t    ggml_rq_get_to_fp16_cuda   (ggml_type type);
to_fp32_cuda_t    ggml_rq_get_to_fp32_cuda   (ggml_type type);
to_bf16_cuda_t    ggml_rq_get_to_bf16_cuda   (ggml_type type);
to_fp16_nc_cuda_t ggml_rq_get_to_fp16_nc_cuda(ggml_type type);
to_fp32_nc_cuda_t ggml_rq_get_to_fp32_nc_cuda(ggml_type type);
to_bf16_nc_cuda_t ggml_rq_get_to_bf16_nc_cuda(ggml_type type);

// SET_ROWS into an IsoQuant tensor (F32 source rows); false: not ours
bool ggml_rq_cuda_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// CPY/DUP/CONT with one of our types on either side; false: not ours (same-type contiguous copies
// are left to upstream's memcpy)
bool ggml_rq_cuda_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1);

// GET_ROWS from IsoQuant / ITQ3_S rows, the arguments of upstream's get_rows_cuda; false: not ours
bool ggml_rq_cuda_get_rows(
        const void * src0_d, ggml_type src0_type, const int32_t * src1_d, void * dst_d, ggml_type dst_type,
        int64_t ne00, size_t nb01, size_t nb02, size_t nb03,
        int64_t ne10, int64_t ne11, int64_t ne12, size_t nb10, size_t nb11, size_t nb12,
        size_t nb1, size_t nb2, size_t nb3,
        cudaStream_t stream);

// MUL_MAT / MUL_MAT_ID (ids != nullptr) with ITQ3_S weights and at most MMVQ_MAX_BATCH_SIZE columns
void ggml_rq_cuda_mul_mat_vec_itq3_s(ggml_backend_cuda_context & ctx,
        const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * ids, ggml_tensor * dst);

// fused IsoQuant flash attention (K and/or V ISOQUANT3_0/4_0 at head size 128/256 or ISOQUANT3_64/4_64 at 64,
// any mix of index widths; a non-IsoQuant side F16 or Q8_0)
bool ggml_rq_cuda_fattn_supported(int device, const ggml_tensor * dst);
void ggml_rq_cuda_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// fused flash-attention ops launched by the CUDA backend (GGML_RQ_ISO_FUSED_CALLS counts the CPU's
// too). Exported from libggml-cuda for tools (scripts/cuda/rq-counters.cpp finds it with dlsym).
extern "C" {
GGML_BACKEND_API uint64_t ggml_rq_cuda_fused_calls(void); // (GGML_BACKEND_API holds an `extern` of its own)
}
