// RotaryQuant CUDA: the dequantising kernels both formats share (to_fp16/fp32/bf16, their _nc twins,
// GET_ROWS), templated on a warp dequantiser D:
//
//   D::block   the quant block;  D::qk  values per block;  D::nv  values per lane;  D::nl  lanes per block
//              (qk = nl*nv; nl = 32: one block per warp, 16: two, side by side)
//   D::dequant(const block *, float v[nv], variant)   lane l of the group gets values nv*l .. nv*l + nv-1
//
// Each format instantiates them in its own .cu file (rq-iso.cu is compiled for exact floats, rq-itq3.cu
// is not), so this header has only static templates.
#pragma once

#include "rq-impl.cuh"
#include "rq-device.cuh"

// ISOQUANT3_0/4_0 (BITS = 3/4, QK = 128) / ISOQUANT3_64/4_64 (QK = 64)
template <int BITS, int QK>
struct rq_iso_deq {
    using block = typename rq_iso_fmt<BITS, QK>::block;
    static constexpr int qk = QK;
    static constexpr int nv = 4;
    static constexpr int nl = QK/4;
    static __device__ __forceinline__ void dequant(const block * b, float v[nv], const int variant) {
        rq_iso_dequant_warp<BITS, QK>(b, v, variant);
    }
};

// ITQ3_S (no variant)
struct rq_itq_deq {
    using block = block_itq3_s;
    static constexpr int qk = QK_ITQ;
    static constexpr int nv = 8;
    static constexpr int nl = WARP_SIZE;
    static __device__ __forceinline__ void dequant(const block * b, float v[nv], const int /*variant*/) {
        rq_itq_dequant_warp(b, v);
    }
};

// the lane's values of block b into y[0 .. qk) (y: the block's first destination value); nothing stored
// when !ok (a group past the end that only joined the shuffles)
template <typename D, typename dst_t>
static __device__ __forceinline__ void rq_dequant_block(const typename D::block * b, dst_t * y, const int variant, const bool ok) {
    float v[D::nv];
    D::dequant(b, v, variant);
    if (!ok) {
        return;
    }
    y += D::nv*rq_lane<D::nl>();
#pragma unroll
    for (int e = 0; e < D::nv; ++e) {
        y[e] = ggml_cuda_cast<dst_t>(v[e]);
    }
}

// ---------------------------------------------------------------------------------------------
// kernels: one group of D::nl lanes per block

template <typename D, typename dst_t>
static __global__ void k_rq_to(const typename D::block * __restrict__ x, dst_t * __restrict__ y, const int64_t nb, const int variant) {
    int64_t ib;
    bool    ok;
    if (!rq_group_block<D::nl>(nb, ib, ok)) {
        return;
    }
    rq_dequant_block<D>(x + ib, y + ib*D::qk, variant, ok);
}

// strided source (strides in blocks), contiguous destination (warp w writes block w)
template <typename D, typename dst_t>
static __global__ void k_rq_to_nc(const typename D::block * __restrict__ x, dst_t * __restrict__ y, const int64_t nw,
        const int64_t nblk, const int64_t ne01, const int64_t ne02,
        const int64_t s01, const int64_t s02, const int64_t s03, const int variant) {
    int64_t w;
    bool    ok;
    if (!rq_group_block<D::nl>(nw, w, ok)) {
        return;
    }
    const auto [ib, i01, i02, i03] = rq_unravel(w, nblk, ne01, ne02);
    rq_dequant_block<D>(x + i03*s03 + i02*s02 + i01*s01 + ib, y + w*D::qk, variant, ok);
}

template <typename D, typename dst_t>
static __global__ void k_rq_get_rows(
        const char * __restrict__ src0, const char * __restrict__ src1, char * __restrict__ dst, const int64_t nw,
        const int64_t nblk, const int64_t ne10, const int64_t ne11,
        const size_t nb01, const size_t nb02, const size_t nb03, const size_t nb10, const size_t nb11, const size_t nb12,
        const size_t nb1, const size_t nb2, const size_t nb3, const int variant) {
    int64_t w;
    bool    ok;
    if (!rq_group_block<D::nl>(nw, w, ok)) {
        return;
    }
    const auto [ib, i10, i11, i12] = rq_unravel(w, nblk, ne10, ne11);

    const int64_t i01 = *(const int32_t *) (src1 + i10*nb10 + i11*nb11 + i12*nb12);

    rq_dequant_block<D>((const typename D::block *) (src0 + i01*nb01 + i11*nb02 + i12*nb03) + ib,
                        (dst_t *) (dst + i10*nb1 + i11*nb2 + i12*nb3) + ib*D::qk, variant, ok);
}

// ---------------------------------------------------------------------------------------------
// host: launch, return the number of blocks dequantised

template <typename D, typename T>
static int64_t rq_to_cuda(const void * x, T * y, const int64_t k, const int variant, cudaStream_t stream) {
    GGML_ASSERT(k % D::qk == 0);
    const int64_t nb = k / D::qk;
    if (nb > 0) {
        k_rq_to<D, T><<<rq_group_grid<D::nl>(nb), rq_warp_block(), 0, stream>>>((const typename D::block *) x, y, nb, variant);
    }
    return nb;
}

template <typename D, typename T>
static int64_t rq_to_nc_cuda(const void * x, T * y, const int64_t ne00, const int64_t ne01, const int64_t ne02, const int64_t ne03,
                             const int64_t s01, const int64_t s02, const int64_t s03, const int variant, cudaStream_t stream) {
    GGML_ASSERT(ne00 % D::qk == 0);
    const int64_t nblk = ne00 / D::qk;
    const int64_t nw   = nblk*ne01*ne02*ne03;
    if (nw > 0) {
        k_rq_to_nc<D, T><<<rq_group_grid<D::nl>(nw), rq_warp_block(), 0, stream>>>(
            (const typename D::block *) x, y, nw, nblk, ne01, ne02, s01, s02, s03, variant);
    }
    return nw;
}

// the signature of upstream's get_rows_cuda, plus the variant
template <typename D>
static int64_t rq_get_rows_cuda(const void * src0_d, const int32_t * src1_d, void * dst_d, const ggml_type dst_type,
        const int64_t ne00, const size_t nb01, const size_t nb02, const size_t nb03,
        const int64_t ne10, const int64_t ne11, const int64_t ne12, const size_t nb10, const size_t nb11, const size_t nb12,
        const size_t nb1, const size_t nb2, const size_t nb3, const int variant, cudaStream_t stream) {
    GGML_ASSERT(ne00 % D::qk == 0);
    const int64_t nblk = ne00 / D::qk;
    const int64_t nw   = nblk*ne10*ne11*ne12;
    if (nw == 0) {
        return 0;
    }
    auto launch = [&](auto dst_zero) {
        using dst_t = decltype(dst_zero);
        k_rq_get_rows<D, dst_t><<<rq_group_grid<D::nl>(nw), rq_warp_block(), 0, stream>>>(
            (const char *) src0_d, (const char *) src1_d, (char *) dst_d, nw, nblk, ne10, ne11,
            nb01, nb02, nb03, nb10, nb11, nb12, nb1, nb2, nb3, variant);
    };
    switch (dst_type) {
        case GGML_TYPE_F32:  launch(float());       break;
        case GGML_TYPE_F16:  launch(half());        break;
        case GGML_TYPE_BF16: launch(nv_bfloat16()); break;
        default: GGML_ABORT("%s: unsupported dst type %s", __func__, ggml_type_name(dst_type));
    }
    return nw;
}
