// ISOQUANT3_0/4_0 and ISOQUANT3_64/4_64 on CUDA, every kernel templated on the index width BITS and the
// block width QK: the device quantiser (SET_ROWS, CPY F32->ISO) and the dequantisers (to_fp16/fp32/bf16 and
// their _nc twins, CPY ISO->F32/F16, GET_ROWS). One group of QK/4 lanes per block (a warp per 128-value
// block, half a warp per 64-value block), lane l of the group owning values 4l..4l+3 (rq-device.cuh).
//
// Bit-exact with ggml-rq/isoquant.c: this file is compiled with -ftz=false -prec-div=true
// -prec-sqrt=true -fmad=false (rq-cuda.cmake), the float64 norm is the same fixed tree
// (64, 32, ..., 1) done with __dadd_rn across lanes, and every float step is an explicit
// round-to-nearest intrinsic in the reference's order. The dequantised floats are bit-identical too,
// so CPY ISO->F16 equals the CPU's cast bit for bit (both round float -> half to nearest even).

#include "rq-impl.cuh"
#include "rq-dequant.cuh"

// sum of the 4*NL values a[] (4 per lane of a group of NL lanes) as isoquant.c's tree: a[i] += a[i + s] for
// s = 2*NL ... 1. s = 2*NL ... 4 pair lane l with l ^ (s/4); s = 2, 1 stay in the group's lane 0. Returns the
// sum in every lane of the group.
template <int NL>
static __device__ __forceinline__ double rq_iso_tree_sum_warp(double a[4]) {
#pragma unroll
    for (int m = NL/2; m >= 1; m >>= 1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            a[e] = __dadd_rn(a[e], __shfl_xor_sync(RQ_FULL_MASK, a[e], m));
        }
    }
    const double s = __dadd_rn(__dadd_rn(a[0], a[2]), __dadd_rn(a[1], a[3]));
    return __shfl_sync(RQ_FULL_MASK, s, 0, NL);
}

// quantize_row_isoquant{3,4}_{0,64}_ref for one block; x[e] = value 4*lane + e (lane in the group of QK/4).
// All 32 lanes take part; a group with !store computes and writes nothing.
template <int BITS, int QK>
static __device__ __forceinline__ void rq_iso_quantize_warp(const float x[4], typename rq_iso_fmt<BITS, QK>::block * y, const int variant,
                                                            const bool store) {
    constexpr int NL = QK/4;
    const int lane = rq_lane<NL>();

    double a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const double xd = (double) x[e];
        a[e] = __dmul_rn(xd, xd);
    }
    const double sd = __dsqrt_rn(rq_iso_tree_sum_warp<NL>(a));

    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v[e] = sd > 0.0 ? __double2float_rn(__ddiv_rn((double) x[e], sd)) : 0.0f;
    }
    rq_iso_rotate_warp<QK>(v, variant);

    uint32_t bits = 0;
    double   c[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int idx = 0;
#pragma unroll
        for (int k = 0; k < (1 << BITS) - 1; ++k) {
            idx += v[e] > rq_iso_level<BITS, true, QK>(k);
        }
        bits |= (uint32_t) idx << (BITS*e);
        const double cd = (double) rq_iso_level<BITS, false, QK>(idx);
        c[e] = __dmul_rn(cd, cd);
    }
    // norm-preserving scale; the codebook has no zero level, so the tree sum is > 0
    const double dd = __ddiv_rn(sd, __dsqrt_rn(rq_iso_tree_sum_warp<NL>(c)));

    const uint32_t hi = __shfl_down_sync(RQ_FULL_MASK, bits, 1); // the group's odd lane (lane + 1 < NL)
    if (!store) {
        return;
    }
    if ((lane & 1) == 0) {
        const uint32_t w = bits | hi << (4*BITS);
        uint8_t * q = y->qs + BITS*(lane >> 1);
#pragma unroll
        for (int b = 0; b < BITS; ++b) {
            q[b] = (uint8_t) ((w >> (8*b)) & 0xff);
        }
    }
    if (lane == 0) {
        y->d = __float2half_rn(__double2float_rn(dd < 65504.0 ? dd : 65504.0));
    }
}

// ---------------------------------------------------------------------------------------------
// kernels

template <typename idx_t, int BITS, int QK>
static __global__ void k_iso_set_rows(
        const char * __restrict__ src0, const char * __restrict__ src1, char * __restrict__ dst, const int64_t nw,
        const int64_t nblk, const int64_t ne01, const int64_t ne02,
        const size_t nb01, const size_t nb02, const size_t nb03,
        const int64_t ne11, const int64_t ne12, const size_t nb10, const size_t nb11, const size_t nb12,
        const size_t nb1, const size_t nb2, const size_t nb3, const int variant) {
    int64_t w;
    bool    ok;
    if (!rq_group_block<QK/4>(nw, w, ok)) {
        return;
    }
    const auto [ib, i01, i02, i03] = rq_unravel(w, nblk, ne01, ne02);

    const int64_t i11 = i02 % ne11;
    const int64_t i12 = i03 % ne12;
    const int64_t dst_row = (int64_t) *(const idx_t *) (src1 + i01*nb10 + i11*nb11 + i12*nb12);

    const float * x = (const float *) (src0 + i01*nb01 + i02*nb02 + i03*nb03) + ib*QK + 4*rq_lane<QK/4>();
    const float v[4] = { x[0], x[1], x[2], x[3] };
    auto * y = (typename rq_iso_fmt<BITS, QK>::block *) (dst + dst_row*nb1 + i02*nb2 + i03*nb3) + ib;
    rq_iso_quantize_warp<BITS, QK>(v, y, variant, ok);
}

// ggml_cpy F32 -> ISO (dst_t = the block: quantise) or ISO -> F32/F16 (dequantise): element order of the
// flattened tensors, one QK-block per group of QK/4 lanes (the rows of both tensors hold whole blocks)
template <int BITS, int QK, typename dst_t>
static __global__ void k_iso_cpy(
        const char * __restrict__ cx, char * __restrict__ cdst, const int64_t nw,
        const int64_t ne00, const int64_t ne01, const int64_t ne02, const int64_t nb00, const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t ne10, const int64_t ne11, const int64_t ne12, const int64_t nb10, const int64_t nb11, const int64_t nb12, const int64_t nb13,
        const int variant) {
    using block = typename rq_iso_fmt<BITS, QK>::block;
    int64_t w;
    bool    ok;
    if (!rq_group_block<QK/4>(nw, w, ok)) {
        return;
    }
    const auto [i00, i01, i02, i03] = rq_unravel(w*QK, ne00, ne01, ne02);
    const auto [i10, i11, i12, i13] = rq_unravel(w*QK, ne10, ne11, ne12);
    const int lane = rq_lane<QK/4>();

    float v[4];
    if constexpr (std::is_same_v<dst_t, block>) {
        const char * x = cx + (i00 + 4*lane)*nb00 + i01*nb01 + i02*nb02 + i03*nb03;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[e] = *(const float *) (x + e*nb00);
        }
        rq_iso_quantize_warp<BITS, QK>(v, (block *) (cdst + (i10/QK)*nb10 + i11*nb11 + i12*nb12 + i13*nb13), variant, ok);
    } else {
        rq_iso_dequant_warp<BITS, QK>((const block *) (cx + (i00/QK)*nb00 + i01*nb01 + i02*nb02 + i03*nb03), v, variant);
        if (!ok) {
            return;
        }
        char * y = cdst + (i10 + 4*lane)*nb10 + i11*nb11 + i12*nb12 + i13*nb13;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            *(dst_t *) (y + e*nb10) = ggml_cuda_cast<dst_t>(v[e]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// host

static int rq_iso_variant() {
    return (int) ggml_rq_iso_get_variant();
}

template <typename T, int BITS, int QK>
void rq_iso_to_cuda(const void * x, T * y, const int64_t k, cudaStream_t stream) {
    const int64_t nb = rq_to_cuda<rq_iso_deq<BITS, QK>>(x, y, k, rq_iso_variant(), stream);
    ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) nb);
}

template <typename T, int BITS, int QK>
void rq_iso_to_nc_cuda(const void * x, T * y, const int64_t ne00, const int64_t ne01, const int64_t ne02, const int64_t ne03,
                       const int64_t s01, const int64_t s02, const int64_t s03, cudaStream_t stream) {
    const int64_t nw = rq_to_nc_cuda<rq_iso_deq<BITS, QK>>(x, y, ne00, ne01, ne02, ne03, s01, s02, s03, rq_iso_variant(), stream);
    ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) nw);
}

#define RQ_ISO_TO_INSTANCES(BITS, QK)                                                                              \
template void rq_iso_to_cuda<float,       BITS, QK>(const void *, float *,       int64_t, cudaStream_t);             \
template void rq_iso_to_cuda<half,        BITS, QK>(const void *, half *,        int64_t, cudaStream_t);             \
template void rq_iso_to_cuda<nv_bfloat16, BITS, QK>(const void *, nv_bfloat16 *, int64_t, cudaStream_t);             \
template void rq_iso_to_nc_cuda<float,       BITS, QK>(const void *, float *,       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t); \
template void rq_iso_to_nc_cuda<half,        BITS, QK>(const void *, half *,        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t); \
template void rq_iso_to_nc_cuda<nv_bfloat16, BITS, QK>(const void *, nv_bfloat16 *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);
RQ_ISO_TO_INSTANCES(3, QK_ISO)
RQ_ISO_TO_INSTANCES(4, QK_ISO)
RQ_ISO_TO_INSTANCES(3, QK_ISO64)
RQ_ISO_TO_INSTANCES(4, QK_ISO64)
#undef RQ_ISO_TO_INSTANCES

void rq_iso_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];

    GGML_TENSOR_BINARY_OP_LOCALS

    GGML_ASSERT(ggml_rq_type_is_iso(dst->type));
    GGML_ASSERT(src0->type == GGML_TYPE_F32 && nb00 == sizeof(float));
    GGML_ASSERT(src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32);
    const int64_t qk = ggml_rq_iso_qk(dst->type);
    GGML_ASSERT(ne00 % qk == 0);

    const int64_t nblk = ne00 / qk;
    const int64_t nw   = nblk*ne01*ne02*ne03;
    if (nw == 0) {
        return;
    }
    cudaStream_t stream = ctx.stream();
    const bool i64 = src1->type == GGML_TYPE_I64;
    rq_iso_with_fmt(dst->type, [&](auto bits, auto qkc) {
        constexpr int B = decltype(bits)::value;
        constexpr int Q = decltype(qkc)::value;
        auto kernel = i64 ? k_iso_set_rows<int64_t, B, Q> : k_iso_set_rows<int32_t, B, Q>;
        kernel<<<rq_group_grid<Q/4>(nw), rq_warp_block(), 0, stream>>>(
            (const char *) src0->data, (const char *) src1->data, (char *) dst->data, nw, nblk, ne01, ne02,
            nb01, nb02, nb03, ne11, ne12, nb10, nb11, nb12, nb1, nb2, nb3, rq_iso_variant());
    });
    ggml_rq_counter_add(GGML_RQ_ISO_QUANT_ROWS, (uint64_t) nw);
}

void rq_iso_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1) {
    const int64_t ne = ggml_nelements(src0);
    GGML_ASSERT(ne == ggml_nelements(src1));
    const int64_t qk = ggml_rq_iso_qk(ggml_rq_type_is_iso(src0->type) ? src0->type : src1->type);
    GGML_ASSERT(qk > 0 && src0->ne[0] % qk == 0 && src1->ne[0] % qk == 0);

    const int64_t nw = ne / qk;
    if (nw == 0) {
        return;
    }
    cudaStream_t stream = ctx.stream();
    const char * cx   = (const char *) src0->data;
    char       * cdst = (char *) src1->data;

#define RQ_CPY_ARGS cx, cdst, nw, \
    src0->ne[0], src0->ne[1], src0->ne[2], (int64_t) src0->nb[0], (int64_t) src0->nb[1], (int64_t) src0->nb[2], (int64_t) src0->nb[3], \
    src1->ne[0], src1->ne[1], src1->ne[2], (int64_t) src1->nb[0], (int64_t) src1->nb[1], (int64_t) src1->nb[2], (int64_t) src1->nb[3], \
    rq_iso_variant()

    if (src0->type == GGML_TYPE_F32 && ggml_rq_type_is_iso(src1->type)) {
        rq_iso_with_fmt(src1->type, [&](auto bits, auto qkc) {
            constexpr int B = decltype(bits)::value;
            constexpr int Q = decltype(qkc)::value;
            k_iso_cpy<B, Q, typename rq_iso_fmt<B, Q>::block><<<rq_group_grid<Q/4>(nw), rq_warp_block(), 0, stream>>>(RQ_CPY_ARGS);
        });
        ggml_rq_counter_add(GGML_RQ_ISO_QUANT_ROWS, (uint64_t) nw);
    } else if (ggml_rq_type_is_iso(src0->type) && (src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16)) {
        const bool f32 = src1->type == GGML_TYPE_F32;
        rq_iso_with_fmt(src0->type, [&](auto bits, auto qkc) {
            constexpr int B = decltype(bits)::value;
            constexpr int Q = decltype(qkc)::value;
            auto kernel = f32 ? k_iso_cpy<B, Q, float> : k_iso_cpy<B, Q, half>;
            kernel<<<rq_group_grid<Q/4>(nw), rq_warp_block(), 0, stream>>>(RQ_CPY_ARGS);
        });
        ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) nw);
    } else {
        GGML_ABORT("%s: unsupported copy %s -> %s", __func__, ggml_type_name(src0->type), ggml_type_name(src1->type));
    }
#undef RQ_CPY_ARGS
}

void rq_iso_get_rows(const void * src0_d, ggml_type src0_type, const int32_t * src1_d, void * dst_d, ggml_type dst_type,
        int64_t ne00, size_t nb01, size_t nb02, size_t nb03,
        int64_t ne10, int64_t ne11, int64_t ne12, size_t nb10, size_t nb11, size_t nb12,
        size_t nb1, size_t nb2, size_t nb3, cudaStream_t stream) {
    rq_iso_with_fmt(src0_type, [&](auto bits, auto qkc) {
        const int64_t nw = rq_get_rows_cuda<rq_iso_deq<decltype(bits)::value, decltype(qkc)::value>>(src0_d, src1_d, dst_d, dst_type,
            ne00, nb01, nb02, nb03, ne10, ne11, ne12, nb10, nb11, nb12, nb1, nb2, nb3, rq_iso_variant(), stream);
        ggml_rq_counter_add(GGML_RQ_ISO_DEQUANT_ROWS, (uint64_t) nw);
    });
}
