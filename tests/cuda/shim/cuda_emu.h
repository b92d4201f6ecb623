// The part of CUDA our kernels use (ggml-patches/src/cuda), as host C++, so that the unchanged .cu sources compile
// with g++ and run on the CPU. Each thread of a block is a fiber (tests/emu/fibers.h, shared with the Metal
// emulation); __syncthreads and every warp operation are the only points where a fiber yields, so lanes interleave
// exactly where CUDA lets them communicate:
//   - __syncthreads(_or) waits for every thread of the block; a thread that returned first is an error (a deadlock);
//   - __shfl_*_sync exchange values within the warp (32 consecutive thread ids) and need the full mask: every lane of
//     the warp must reach the same call (one that returned, or waits at __syncthreads, is an error: undefined on a
//     GPU), width segments as CUDA defines them;
//   - __shared__ variables are function-local statics, filled with 0xff (NaN) before each block (found in the
//     executable's symbol table: link without PIE), and lanes run in a chosen order (rq_cuda::order: forward,
//     reverse), so a read that a missing barrier leaves unordered sees poison or another order's value;
//   - rounding: __fadd_rn & co. are the IEEE operations (compiled with -ffp-contract=off), half is _Float16 and
//     nv_bfloat16 rounds to nearest even, as CUDA's conversions do; expf/tanhf/powf are glibc's, not CUDA's (whose
//     error bounds are a few ulp): kernels that use them are checked within a stated tolerance, not bit for bit.
// What this does not model: nvcc (fast math, contraction, register allocation), timing, occupancy, memory coalescing,
// bank conflicts, partial-mask warp operations (refused), and device atomics (none of our kernels use them).
#pragma once

#include "../../emu/fibers.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};
using uint3 = dim3;

struct CUstream_st;
typedef CUstream_st * cudaStream_t;

// ---------------------------------------------------------------------------------------------------------------
// vector types, half, bfloat16

struct __align__(8)  float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8)  int2   { int x, y; };
inline float2 make_float2(float x, float y) { return { x, y }; }

using half = _Float16;
struct __align__(4) half2 { half x, y; };

struct nv_bfloat16 {
    uint16_t bits;
};

inline float __half2float(half h) { return (float) h; }
inline half __float2half_rn(float f) { return (half) f; }   // round to nearest even, as CUDA's
inline half __ushort_as_half(unsigned short u) { half h; memcpy(&h, &u, 2); return h; }
inline float2 __half22float2(half2 h) { return { (float) h.x, (float) h.y }; }

inline nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return { (uint16_t) ((u >> 16) | 0x40) };   // a quiet NaN
    }
    return { (uint16_t) ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) };
}
inline float __bfloat162float(nv_bfloat16 b) {
    const uint32_t u = (uint32_t) b.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// ---------------------------------------------------------------------------------------------------------------
// rounding intrinsics: the IEEE operations themselves (the build turns contraction off)

inline float  __fadd_rn(float a, float b) { return a + b; }
inline float  __fsub_rn(float a, float b) { return a - b; }
inline float  __fmul_rn(float a, float b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float  __double2float_rn(double a) { return (float) a; }
inline int    __float2int_rn(float a) { return (int) std::nearbyint(a); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// byte s_i (0..7) of the 8-byte value {y:x} into byte i of the result; the sign-replicating selector bit is not
// modelled (none of our selectors sets it)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (uint64_t) y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4*i)) & 0xf;
        if (sel & 8) {
            rq_fiber::fail("__byte_perm with a sign-replicating selector is not modelled");
        }
        r |= (unsigned) ((v >> (8*sel)) & 0xff) << (8*i);
    }
    return r;
}

// ---------------------------------------------------------------------------------------------------------------
// the grid

namespace rq_cuda {

inline dim3 grid_dim, block_dim, block_idx;

inline dim3 thread_idx() {
    const unsigned t = rq_fiber::me().tid;
    return dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x*block_dim.y));
}

inline void full_mask(unsigned mask) {
    if (mask != 0xffffffffu) {
        rq_fiber::fail("a warp operation with a partial mask: not modelled");
    }
}

template <typename T> inline T shfl(T v, const char * site, unsigned src_lane_in_warp) {
    const unsigned tid = rq_fiber::me().tid;
    return rq_fiber::simd_exchange(v, site, tid - tid % 32 + src_lane_in_warp);
}

} // namespace rq_cuda

#define threadIdx (rq_cuda::thread_idx())
#define blockIdx  (rq_cuda::block_idx)
#define blockDim  (rq_cuda::block_dim)
#define gridDim   (rq_cuda::grid_dim)

inline void __syncthreads() {
    rq_fiber::barrier();
}

inline int __syncthreads_or(int pred) {
    int r = 0;
    rq_fiber::barrier(pred, &r);
    return r;
}

// CUDA's segments of `width` lanes: a source outside the caller's segment gives the caller's own value
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    rq_cuda::full_mask(mask);
    const unsigned lane = rq_fiber::me().tid % 32, base = lane - lane % width;
    return rq_cuda::shfl(v, "__shfl_sync", base + ((unsigned) src % width));
}

template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    rq_cuda::full_mask(mask);
    const unsigned lane = rq_fiber::me().tid % 32, dst = lane ^ (unsigned) lane_mask;
    return rq_cuda::shfl(v, "__shfl_xor_sync", dst / width == lane / width ? dst : lane);
}

template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    rq_cuda::full_mask(mask);
    const unsigned lane = rq_fiber::me().tid % 32, dst = lane + delta;
    return rq_cuda::shfl(v, "__shfl_down_sync", dst / width == lane / width ? dst : lane);
}

template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    rq_cuda::full_mask(mask);
    const unsigned lane = rq_fiber::me().tid % 32;
    const unsigned dst = lane >= delta && (lane - delta) / width == lane / width ? lane - delta : lane;
    return rq_cuda::shfl(v, "__shfl_up_sync", dst);
}

// ---------------------------------------------------------------------------------------------------------------
// kernel launches: the one textual change made to the sources is `k<<<grid, block, smem, stream>>>(args)` ->
// `rq_cuda_launch(k, grid, block, smem, stream)(args)`

namespace rq_cuda {

inline int order = 0;                           // lanes forward (0) or in reverse (1)
inline unsigned long launches = 0, blocks = 0;  // what ran, for the runner's report

// __shared__ variables are the function-local statics of our kernels (all `static` functions, so their statics are
// local symbols, mangled _ZZ..., where the shim's own statics live in inline functions: unique symbols). They are
// found once in this executable's symbol table (link without PIE: the addresses are the ones nm prints) and filled
// with 0xff before every block.
struct shared_vars {
    std::vector<std::pair<char *, size_t>> vars;
    size_t bytes = 0;
};

inline const shared_vars & find_shared() {
    static const shared_vars sv = [] {
        shared_vars r;
        char exe[4096] = {};
        if (readlink("/proc/self/exe", exe, sizeof(exe) - 1) <= 0) {
            rq_fiber::fail("cannot find this executable (/proc/self/exe) to read its symbols");
        }
        const std::string cmd = std::string("nm -S --defined-only '") + exe + "'";
        FILE * p = popen(cmd.c_str(), "r");
        if (!p) {
            rq_fiber::fail("cannot run nm to find the __shared__ variables");
        }
        char line[4096];
        while (fgets(line, sizeof(line), p)) {
            unsigned long long addr = 0, size = 0;
            char type = 0, name[3500] = {};
            if (sscanf(line, "%llx %llx %c %3499s", &addr, &size, &type, name) == 4 && strncmp(name, "_ZZ", 3) == 0 &&
                (type == 'b' || type == 'd')) {
                r.vars.emplace_back((char *) (uintptr_t) addr, (size_t) size);
                r.bytes += size;
            }
        }
        pclose(p);   // none: a program without __shared__ variables (or linked with PIE: the runner reports the bytes)
        return r;
    }();
    return sv;
}

inline size_t shared_bytes() { return find_shared().bytes; }

inline void poison_shared() {
    for (const auto & [p, n] : find_shared().vars) {
        memset(p, 0xff, n);
    }
}

template <typename... P> struct launcher {
    void (*k)(P...);
    dim3 grid, block;

    template <typename... A> void operator()(A &&... a) const {
        static_assert(sizeof...(A) == sizeof...(P), "kernel arguments");
        const std::tuple<std::decay_t<P>...> args(static_cast<std::decay_t<P>>(std::forward<A>(a))...); // by value, once
        const unsigned nx = grid.x, ny = grid.y, nz = grid.z;
        const unsigned threads = block.x*block.y*block.z;
        if (threads == 0 || threads > 1024 || nx == 0 || ny == 0 || nz == 0 || ny > 65535 || nz > 65535) {
            rq_fiber::fail("a launch configuration CUDA refuses");
        }
        rq_fiber::emu_name     = "cuda emulation";
        rq_fiber::barrier_name = "__syncthreads";
        grid_dim  = grid;
        block_dim = block;
        launches++;
        rq_fiber::dispatch(nx*ny*nz, threads, [&](unsigned, unsigned) { std::apply(k, args); }, order, 32, true,
                           [&](unsigned g) {
                               block_idx = dim3(g % nx, (g / nx) % ny, g / (nx*ny));
                               blocks++;
                               poison_shared();
                           });
    }
};

} // namespace rq_cuda

template <typename... P>
inline rq_cuda::launcher<P...> rq_cuda_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t) {
    if (smem != 0) {
        rq_fiber::fail("dynamic shared memory is not modelled");
    }
    return { k, grid, block };
}
