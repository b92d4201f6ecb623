// Stands in for upstream's ggml-cuda/convert.cuh in the CUDA emulation: the dequantiser types and ggml_cuda_cast
// (upstream's conversions for the pairs our kernels store: float to float, half and nv_bfloat16, all rounding to
// nearest even)
#pragma once

#include "common.cuh"

template <typename T>
using to_t_cuda_t = void (*)(const void * x, T * y, int64_t k, cudaStream_t stream);
typedef to_t_cuda_t<float>       to_fp32_cuda_t;
typedef to_t_cuda_t<half>        to_fp16_cuda_t;
typedef to_t_cuda_t<nv_bfloat16> to_bf16_cuda_t;

template <typename T>
using to_t_nc_cuda_t = void (*)(const void * x, T * y, int64_t ne00, int64_t ne01, int64_t ne02, int64_t ne03,
                                int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream);
typedef to_t_nc_cuda_t<float>       to_fp32_nc_cuda_t;
typedef to_t_nc_cuda_t<half>        to_fp16_nc_cuda_t;
typedef to_t_nc_cuda_t<nv_bfloat16> to_bf16_nc_cuda_t;

template <typename dst_t, typename src_t>
inline dst_t ggml_cuda_cast(src_t x) {
    if constexpr (std::is_same_v<dst_t, src_t>) {
        return x;
    } else if constexpr (std::is_same_v<dst_t, nv_bfloat16>) {
        return __float2bfloat16(float(x));
    } else {
        return dst_t(float(x));
    }
}
