// RotaryQuant CUDA: declarations shared between our .cu files (not seen by upstream code).
#pragma once

#include "rq-cuda.cuh"
#include "ggml-rq.h"

#define RQ_WARPS_PER_BLOCK 4 // kernels that give one warp to one quant block use 4 warps per CUDA block

// ISOQUANT3_0/4_0 (BITS = 3/4, QK = 128) and ISOQUANT3_64/4_64 (QK = 64) (rq-iso.cu)
template <typename T, int BITS, int QK> void rq_iso_to_cuda(const void * x, T * y, int64_t k, cudaStream_t stream);
template <typename T, int BITS, int QK> void rq_iso_to_nc_cuda(const void * x, T * y, int64_t ne00, int64_t ne01, int64_t ne02, int64_t ne03,
                                             int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream);
void rq_iso_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void rq_iso_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1);
void rq_iso_get_rows(const void * src0_d, ggml_type src0_type, const int32_t * src1_d, void * dst_d, ggml_type dst_type,
        int64_t ne00, size_t nb01, size_t nb02, size_t nb03,
        int64_t ne10, int64_t ne11, int64_t ne12, size_t nb10, size_t nb11, size_t nb12,
        size_t nb1, size_t nb2, size_t nb3, cudaStream_t stream);

// ITQ3_S (rq-itq3.cu)
template <typename T> void rq_itq_to_cuda(const void * x, T * y, int64_t k, cudaStream_t stream);
template <typename T> void rq_itq_to_nc_cuda(const void * x, T * y, int64_t ne00, int64_t ne01, int64_t ne02, int64_t ne03,
                                             int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream);
void rq_itq_get_rows(const void * src0_d, const int32_t * src1_d, void * dst_d, ggml_type dst_type,
        int64_t ne00, size_t nb01, size_t nb02, size_t nb03,
        int64_t ne10, int64_t ne11, int64_t ne12, size_t nb10, size_t nb11, size_t nb12,
        size_t nb1, size_t nb2, size_t nb3, cudaStream_t stream);

// grid size for n warps of RQ_WARPS_PER_BLOCK per block
static inline dim3 rq_warp_grid(int64_t n) {
    const int64_t nblk = (n + RQ_WARPS_PER_BLOCK - 1) / RQ_WARPS_PER_BLOCK;
    GGML_ASSERT(nblk < INT32_MAX);
    return dim3((unsigned) nblk, 1, 1);
}

static inline dim3 rq_warp_block() {
    return dim3(WARP_SIZE, RQ_WARPS_PER_BLOCK, 1);
}

// in such a kernel: the warp's index in the grid
static __device__ __forceinline__ int64_t rq_warp_id() {
    return (int64_t) blockIdx.x*blockDim.y + threadIdx.y;
}

// kernels that give a group of NL lanes to one block (NL = 32: a warp per block; NL = 16: two 64-value
// IsoQuant blocks per warp, lanes 0..15 and 16..31): the grid for n blocks ...
template <int NL>
static inline dim3 rq_group_grid(const int64_t n) {
    constexpr int G = WARP_SIZE/NL;
    return rq_warp_grid((n + G - 1)/G);
}

// ... and the group's block i. false: the whole warp is past n (return). A group past n in a warp that still
// has a block gets i = n - 1 and ok = false: its lanes take part in the warp's shuffles and store nothing.
template <int NL>
static __device__ __forceinline__ bool rq_group_block(const int64_t n, int64_t & i, bool & ok) {
    constexpr int G = WARP_SIZE/NL;
    const int64_t i0 = rq_warp_id()*G;
    if (i0 >= n) {
        return false;
    }
    i  = i0 + threadIdx.x/NL;
    ok = i < n;
    if (!ok) {
        i = n - 1;
    }
    return true;
}

// i = ((i3*n2 + i2)*n1 + i1)*n0 + i0 -> { i0, i1, i2, i3 } (i3 unbounded)
struct rq_idx4 {
    int64_t i0, i1, i2, i3;
};

static __device__ __forceinline__ rq_idx4 rq_unravel(int64_t i, const int64_t n0, const int64_t n1, const int64_t n2) {
    rq_idx4 r;
    r.i0 = i % n0; i /= n0;
    r.i1 = i % n1; i /= n1;
    r.i2 = i % n2;
    r.i3 = i / n2;
    return r;
}
