// Stands in for upstream's ggml-cuda/common.cuh in the CUDA emulation: what our sources take from it. The warp
// reductions and ggml_cuda_dp4a follow upstream's definitions (the same shuffle partners and order); the backend
// context, its pool and the device table are host-side stand-ins (a pool allocation is filled with 0xff, as device
// memory holds whatever was there; the SM count is rq_cuda::n_sm, which the runner sets).
#pragma once

#include "../cuda_emu.h"

#include "ggml.h"
#include "ggml-impl.h"
#include "ggml-backend.h"

#define GGML_COMMON_DECL_CUDA
#include "ggml-common.h"

#include <vector>

#define WARP_SIZE 32

template <int width = WARP_SIZE>
static inline float warp_reduce_sum(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, offset, width);
    }
    return x;
}

template <int width = WARP_SIZE>
static inline float warp_reduce_max(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset, width));
    }
    return x;
}

// __dp4a: c + the sum of the four signed byte products
static inline int ggml_cuda_dp4a(const int a, const int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int) (int8_t) (a >> (8*i)) * (int) (int8_t) (b >> (8*i));
    }
    return c;
}

namespace rq_cuda {
inline int n_sm = 132;   // the streaming multiprocessors the host code sizes its grids for (an H100/H200 has 132)
}

struct ggml_cuda_device_info {
    struct cuda_device_info {
        int cc  = 900;
        int nsm = 0;
    };
    cuda_device_info devices[1];
};

inline const ggml_cuda_device_info & ggml_cuda_info() {
    static ggml_cuda_device_info info;
    info.devices[0].nsm = rq_cuda::n_sm;
    return info;
}

struct ggml_cuda_pool {};

template <typename T>
struct ggml_cuda_pool_alloc {
    std::vector<unsigned char> buf;
    ggml_cuda_pool_alloc(ggml_cuda_pool &, size_t n) : buf(n*sizeof(T), 0xff) {}
    T * get() { return (T *) buf.data(); }
};

struct ggml_backend_cuda_context {
    int            device = 0;
    ggml_cuda_pool pool_;
    cudaStream_t   stream() { return nullptr; }
    ggml_cuda_pool & pool() { return pool_; }
};
