// ITQ3_S on CUDA: dequantisation (to_fp16/fp32/bf16 and _nc, GET_ROWS) with the inverse FWHT done by
// one warp per 256-weight block, and the small-batch matrix-vector product (the MMVQ slot):
//
//   1. k_itq_quantize_act: every 256-block of every activation row is rotated once, y = FWHT256(S x),
//      then quantised to int8 with one float scale per block (block_q8_itq below).
//   2. k_itq_mmvq: w.x = sum_b dw_b dy_b <grid[q_b], qy_b> + mw_b dy_b sum(qy_b). The 3-bit codes turn
//      into int8 grid values with one __byte_perm per 4 codes and meet the activations in __dp4a; the
//      weights are never inverse-transformed.
//
// Larger batches (prefill) take upstream's cuBLAS path: to_fp16 (inverse FWHT per block) + GEMM.

#include "rq-impl.cuh"
#include "rq-dequant.cuh"
#include "ggml-cuda/mmvq.cuh"

// rotated activations of one 256-block
struct block_q8_itq {
    float  d;          // scale: y ~ d * qs
    float  ds;         // d * sum(qs), for the offset term m * sum(y)
    int8_t qs[QK_ITQ];
};
static_assert(sizeof(block_q8_itq) == 2*sizeof(float) + QK_ITQ, "wrong block_q8_itq size");

// ---------------------------------------------------------------------------------------------
// dequantisation (kernels in rq-dequant.cuh)

template <typename T>
void rq_itq_to_cuda(const void * x, T * y, const int64_t k, cudaStream_t stream) {
    rq_to_cuda<rq_itq_deq>(x, y, k, 0, stream);
}

template <typename T>
void rq_itq_to_nc_cuda(const void * x, T * y, const int64_t ne00, const int64_t ne01, const int64_t ne02, const int64_t ne03,
                       const int64_t s01, const int64_t s02, const int64_t s03, cudaStream_t stream) {
    rq_to_nc_cuda<rq_itq_deq>(x, y, ne00, ne01, ne02, ne03, s01, s02, s03, 0, stream);
}

template void rq_itq_to_cuda<float>      (const void *, float *,       int64_t, cudaStream_t);
template void rq_itq_to_cuda<half>       (const void *, half *,        int64_t, cudaStream_t);
template void rq_itq_to_cuda<nv_bfloat16>(const void *, nv_bfloat16 *, int64_t, cudaStream_t);
template void rq_itq_to_nc_cuda<float>      (const void *, float *,       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);
template void rq_itq_to_nc_cuda<half>       (const void *, half *,        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);
template void rq_itq_to_nc_cuda<nv_bfloat16>(const void *, nv_bfloat16 *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);

void rq_itq_get_rows(const void * src0_d, const int32_t * src1_d, void * dst_d, ggml_type dst_type,
        int64_t ne00, size_t nb01, size_t nb02, size_t nb03,
        int64_t ne10, int64_t ne11, int64_t ne12, size_t nb10, size_t nb11, size_t nb12,
        size_t nb1, size_t nb2, size_t nb3, cudaStream_t stream) {
    rq_get_rows_cuda<rq_itq_deq>(src0_d, src1_d, dst_d, dst_type,
        ne00, nb01, nb02, nb03, ne10, ne11, ne12, nb10, nb11, nb12, nb1, nb2, nb3, 0, stream);
}

// ---------------------------------------------------------------------------------------------
// matrix-vector product

// one warp per 256-block of one activation row (rows r = i11 + ne11*(i12 + ne12*i13), contiguous output)
static __global__ void k_itq_quantize_act(const char * __restrict__ x, block_q8_itq * __restrict__ y, const int64_t nw,
        const int64_t nblk, const int64_t ne11, const int64_t ne12,
        const size_t nb11, const size_t nb12, const size_t nb13) {
    const int64_t w = rq_warp_id();
    if (w >= nw) {
        return;
    }
    const int lane = rq_lane();
    const auto [ib, i11, i12, i13] = rq_unravel(w, nblk, ne11, ne12);

    const float * xb = (const float *) (x + i11*nb11 + i12*nb12 + i13*nb13) + ib*QK_ITQ + 8*lane;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        v[e] = xb[e]*itq3_signs[8*lane + e];
    }
    rq_fwht256_warp(v);

    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        amax = fmaxf(amax, fabsf(v[e]));
    }
    amax = warp_reduce_max(amax);
    const float d  = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;

    int q[8];
    int sum = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        q[e] = __float2int_rn(v[e]*id);
        sum += q[e];
    }
#pragma unroll
    for (int m = WARP_SIZE/2; m > 0; m >>= 1) {
        sum += __shfl_xor_sync(RQ_FULL_MASK, sum, m);
    }

    block_q8_itq * yb = y + w;
    int2 packed;
    packed.x = (q[0] & 0xff) | (q[1] & 0xff) << 8 | (q[2] & 0xff) << 16 | (q[3] & 0xff) << 24;
    packed.y = (q[4] & 0xff) | (q[5] & 0xff) << 8 | (q[6] & 0xff) << 16 | (q[7] & 0xff) << 24;
    *(int2 *) (yb->qs + 8*lane) = packed;
    if (lane == 0) {
        yb->d  = d;
        yb->ds = d*(float) sum;
    }
}

// 4 codes (bytes 0..7) -> 4 int8 grid values: __byte_perm picks byte c of the 8-byte table {glo, ghi}
static __device__ __forceinline__ int rq_itq_grid4(const uint32_t c, const uint32_t glo, const uint32_t ghi) {
    const uint32_t sel = (c & 0x7u) | ((c >> 4) & 0x70u) | ((c >> 8) & 0x700u) | ((c >> 12) & 0x7000u);
    return (int) __byte_perm(glo, ghi, sel);
}

#define RQ_ITQ_NWARPS 4

// dst[row, j] = x[row] . y[j] for ncols columns. MUL_MAT: blockIdx.y = channel, .z = sample, the ncols
// columns share the weight row. MUL_MAT_ID (ids != nullptr, ncols == 1): blockIdx.y = expert slot e,
// .z = token t, weight matrix ids[e + t*ids_stride], activation row (t*ne11 + e % ne11).
template <int ncols>
__launch_bounds__(RQ_ITQ_NWARPS*WARP_SIZE, 1)
static __global__ void k_itq_mmvq(
        const char * __restrict__ vx, const block_q8_itq * __restrict__ vy, const int32_t * __restrict__ ids, float * __restrict__ dst,
        const int nblk, const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int ne11, const int ne12, const int r2, const int r3, const int64_t ids_stride,
        const int64_t s1, const int64_t s2, const int64_t s3) {
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int row  = blockIdx.x;
    const int i2   = blockIdx.y;
    const int i3   = blockIdx.z;

    const char * x;
    const block_q8_itq * y;
    float * d;
    if (ids) {
        const int32_t e = ids[i2 + i3*ids_stride];
        x = vx + e*nb02;
        y = vy + (int64_t) (i3*ne11 + i2 % ne11)*nblk;
        d = dst + i2*s1 + i3*s2;
    } else {
        x = vx + (i2/r2)*nb02 + (i3/r3)*nb03;
        y = vy + (int64_t) (i3*ne12 + i2)*ne11*nblk;
        d = dst + i2*s2 + i3*s3;
    }
    const block_itq3_s * xr = (const block_itq3_s *) (x + row*nb01);

    uint32_t glo = 0, ghi = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        glo |= (uint32_t) (uint8_t) itq3_grid[k]     << (8*k);
        ghi |= (uint32_t) (uint8_t) itq3_grid[k + 4] << (8*k);
    }

    float acc[ncols] = { 0.0f };
    for (int ib = warp; ib < nblk; ib += RQ_ITQ_NWARPS) {
        const block_itq3_s * b = xr + ib;
        uint32_t c[2];
        rq_itq_lane_codes(b, lane, c);
        const int g0 = rq_itq_grid4(c[0], glo, ghi);
        const int g1 = rq_itq_grid4(c[1], glo, ghi);
        const float dw = __half2float(b->d);
        const float mw = __half2float(b->m);
#pragma unroll
        for (int j = 0; j < ncols; ++j) {
            const block_q8_itq * yb = y + (int64_t) j*nblk + ib;
            const int2 q = *(const int2 *) (yb->qs + 8*lane);
            const int isum = ggml_cuda_dp4a(g1, q.y, ggml_cuda_dp4a(g0, q.x, 0));
            acc[j] += dw*yb->d*(float) isum + (lane == 0 ? mw*yb->ds : 0.0f);
        }
    }

    __shared__ float red[RQ_ITQ_NWARPS][ncols];
#pragma unroll
    for (int j = 0; j < ncols; ++j) {
        const float s = warp_reduce_sum(acc[j]);
        if (lane == 0) {
            red[warp][j] = s;
        }
    }
    __syncthreads();
    if (warp == 0 && lane < ncols) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < RQ_ITQ_NWARPS; ++k) {
            s += red[k][lane];
        }
        d[lane*s1 + row] = s;
    }
}

void ggml_rq_cuda_mul_mat_vec_itq3_s(ggml_backend_cuda_context & ctx,
        const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * ids, ggml_tensor * dst) {
    GGML_TENSOR_BINARY_OP_LOCALS

    GGML_ASSERT(src0->type == GGML_TYPE_ITQ3_S);
    GGML_ASSERT(src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32);
    GGML_ASSERT(nb00 == ggml_type_size(src0->type) && nb10 == sizeof(float) && nb0 == sizeof(float));
    GGML_ASSERT(ne00 % QK_ITQ == 0 && ne00 == ne10);
    GGML_ASSERT(!ids || ids->type == GGML_TYPE_I32);

    cudaStream_t stream = ctx.stream();
    const int64_t nblk = ne00 / QK_ITQ;

    // 1. rotate + quantise every activation row once
    const int64_t nw = nblk*ne11*ne12*ne13;
    if (nw == 0 || ne01 == 0) {
        return;
    }
    ggml_cuda_pool_alloc<block_q8_itq> act(ctx.pool(), nw);
    k_itq_quantize_act<<<rq_warp_grid(nw), rq_warp_block(), 0, stream>>>(
        (const char *) src1->data, act.get(), nw, nblk, ne11, ne12, nb11, nb12, nb13);

    // 2. integer dots
    const int64_t s1 = nb1/sizeof(float);
    const int64_t s2 = nb2/sizeof(float);
    const int64_t s3 = nb3/sizeof(float);

    int ncols;
    dim3 grid;
    int64_t ids_stride = 0;
    if (ids) {
        // dst [ne0, n_expert_used, n_tokens]; src1 [ne10, ne11 (1 or n_expert_used), n_tokens]
        GGML_ASSERT(ne13 == 1 && ne3 == 1);
        ncols      = 1;
        grid       = dim3((unsigned) ne01, (unsigned) ne1, (unsigned) ne2);
        ids_stride = ids->nb[1] / ggml_type_size(ids->type);
        GGML_ASSERT(ne2 <= 65535 && ne1 <= 65535);
    } else {
        GGML_ASSERT(ne11 <= MMVQ_MAX_BATCH_SIZE);
        GGML_ASSERT(ne12 % ne02 == 0 && ne13 % ne03 == 0);
        ncols = (int) ne11;
        grid  = dim3((unsigned) ne01, (unsigned) ne12, (unsigned) ne13);
        GGML_ASSERT(ne12 <= 65535 && ne13 <= 65535);
    }
    GGML_ASSERT(ne01 < INT32_MAX);
    const int r2 = ids ? 1 : (int) (ne12/ne02);
    const int r3 = ids ? 1 : (int) (ne13/ne03);
    const dim3 block(WARP_SIZE, RQ_ITQ_NWARPS, 1);

#define RQ_MMVQ_ARGS (const char *) src0->data, act.get(), ids ? (const int32_t *) ids->data : nullptr, (float *) dst->data, \
    (int) nblk, (int64_t) nb01, (int64_t) nb02, (int64_t) nb03, (int) ne11, (int) ne12, r2, r3, ids_stride, s1, s2, s3

    switch (ncols) {
        case 1: k_itq_mmvq<1><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 2: k_itq_mmvq<2><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 3: k_itq_mmvq<3><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 4: k_itq_mmvq<4><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 5: k_itq_mmvq<5><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 6: k_itq_mmvq<6><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 7: k_itq_mmvq<7><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        case 8: k_itq_mmvq<8><<<grid, block, 0, stream>>>(RQ_MMVQ_ARGS); break;
        default: GGML_ABORT("%s: %d columns", __func__, ncols);
    }
#undef RQ_MMVQ_ARGS
}
