// Fused IsoQuant flash attention on CUDA: FLASH_ATTN_EXT with IsoQuant K and/or V (any mix of the two
// index widths; a non-IsoQuant side F16 or Q8_0): ISOQUANT3_0/4_0 (128-value blocks) at head sizes 128 and
// 256, ISOQUANT3_64/4_64 (64-value blocks) at head size 64; any n_kv, any batch, GQA, mask, ALiBi, softcap
// and sinks. KB/VB, the template index widths of K/V, are 3, 4 or 0 (not IsoQuant); the block width QK
// follows from D (64 -> 64, else 128). Nothing is converted to F16: packed K/V are read as they are stored.
//
//   k.q            = sum_b d_b * <c[idx_b], (R q)_b>          -> Q is rotated once per (row, head), keys
//                                                               are scored straight from the codebook
//   sum_j p_j v_j  = R^T sum_j p_j d_j c[idx_j]               -> V is accumulated in the rotated domain,
//                                                               R^T applied once per output row
//
// Grid: x = tiles of NC query columns (a column is one (query row, head) pair; the g = n_head/n_head_kv
// heads that share a KV head are neighbouring columns, so one block reads each packed K/V row once for
// all of them), y = KV head x sequence, z = KV splits. 128 threads walk the KV range in tiles of 128 rows:
//   1. stage: the packed rows of the tile are copied to shared memory (coalesced 16-bit loads)
//   2. score: thread t scores KV row t against all NC columns (no cross-lane reductions)
//   3. online softmax per column (one warp per column), then the V tile is staged
//   4. accumulate: lane l of every warp owns values 4l..4l+3 of each 128-block (one SO(4) group), the
//      4 warps take every 4th row; probabilities come from shared memory. With 64-value blocks (D = 64)
//      the two half-warps take different rows (lane l % 16 owns values 4l..4l+3), 8 rows at a time
// Each (column, split) writes the un-normalised rotated accumulator, its max and its sum; a second kernel
// merges the splits, adds the sink, normalises, applies R^T (one warp per output row) and writes dst.

#include "rq-impl.cuh"
#include "rq-device.cuh"
#include "fattn-iso.cuh"

#include <atomic>

// ---------------------------------------------------------------------------------------------
// kernels (their device pieces: fattn-iso.cuh)

template <int D, int NC, int KB, int VB>
__launch_bounds__(RQ_FA_NTHREADS, 1)
static __global__ void k_rq_fattn(const rq_fa_params p) {
    using B = rq_fa_block<D, NC, KB, VB>;
    constexpr int QK = B::QK, NL = B::NL, NB = B::NB, EPL = B::EPL, SW = B::SW;

    __shared__ __align__(16) float Qs[NC][D];
    __shared__ float    KQ[RQ_FA_TILE][NC];
    __shared__ uint32_t stage[RQ_FA_TILE*SW];
    __shared__ float    dsh[RQ_FA_TILE*NB];
    __shared__ float    M_sh[NC], S_sh[NC], ms_sh[NC];
    __shared__ float    cbk_sh[16], cbv_sh[16]; // the codebooks of K and V (the first 8 entries for 3 bits)

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid  = warp*WARP_SIZE + lane;
    const int sl   = lane % NL;      // lane in its block group
    const int sr   = lane / NL;      // group in the warp (0, or 0/1 for 64-value blocks)

    const int f0  = blockIdx.x*NC;
    const int ik2 = blockIdx.y % p.n_head_kv;
    const int i3  = blockIdx.y / p.n_head_kv;
    const int ncols_total = p.N*p.gqa;

    const char * K = p.K + ik2*p.nbk2 + i3*p.nbk3;
    const char * V = p.V + ik2*p.nbv2 + i3*p.nbv3;

    // per column: validity, mask row, ALiBi slope
    bool         cvalid[NC];
    const half * mrow[NC];
    float        slope[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int f   = f0 + c;
        cvalid[c]     = f < ncols_total;
        const int iq1 = cvalid[c] ? f / p.gqa : 0;
        const int h   = ik2*p.gqa + (cvalid[c] ? f % p.gqa : 0);
        mrow[c] = p.mask ? (const half *) ((const char *) p.mask + iq1*p.nbm1 + (h % p.ne_m2)*p.nbm2 + (i3 % p.ne_m3)*p.nbm3) : nullptr;
        slope[c] = 1.0f;
        if (p.max_bias > 0.0f) {
            slope[c] = h < p.n_head_log2 ? powf(p.m0, h + 1) : powf(p.m1, 2*(h - p.n_head_log2) + 1);
        }
    }

    B::load_q(p, f0, ik2, i3, ncols_total, warp, sl, sr, Qs);
    if constexpr (B::K_ISO) {
        if (tid < (1 << KB)) {
            cbk_sh[tid] = rq_iso_level<KB, false, QK>(tid);
        }
    }
    if constexpr (B::V_ISO) {
        if (tid < (1 << VB)) {
            cbv_sh[tid] = rq_iso_level<VB, false, QK>(tid);
        }
    }
    if (tid < NC) {
        M_sh[tid] = -INFINITY;
        S_sh[tid] = 0.0f;
    }

    float acc[NC][EPL];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            acc[c][k] = 0.0f;
        }
    }

    const int kv_begin = blockIdx.z*p.kv_chunk;
    const int kv_end   = min(p.n_kv, kv_begin + p.kv_chunk);

    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += RQ_FA_TILE) {
        // mask of this thread's row; a tile no column can see is skipped as a whole (causal prefill)
        const int  kv    = kv0 + tid;
        const bool in    = kv < kv_end;
        float mv[NC];
        bool  row_any = false;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            mv[c] = -INFINITY;
            if (in && cvalid[c]) {
                mv[c] = mrow[c] ? slope[c]*__half2float(mrow[c][kv]) : 0.0f;
            }
            row_any = row_any || mv[c] != -INFINITY;
        }
        // also the barrier that protects KQ/stage from the previous tile's readers
        if (!__syncthreads_or(row_any)) {
            continue;
        }

        // 1. stage K
        if constexpr (B::K_ISO) {
            rq_fa_stage<NB, SW, KB, QK>(K, p.nbk1, kv0, kv_end, stage, dsh);
            __syncthreads();
        }

        // 2. scores
        float s[NC];
        B::score(p, K, kv, tid, row_any, mv, stage, dsh, Qs, cbk_sh, s);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            KQ[tid][c] = s[c];
        }
        __syncthreads();

        // 3. online softmax, one warp per column; then stage V (K's staged rows are no longer read)
        B::softmax(warp, lane, KQ, M_sh, S_sh, ms_sh);
        if constexpr (B::V_ISO) {
            rq_fa_stage<NB, SW, VB, QK>(V, p.nbv1, kv0, kv_end, stage, dsh);
        }
        __syncthreads();

        // 4. accumulate p * V (rotated domain for ISO V)
        B::accumulate(p, V, kv0, kv_end, warp, sl, sr, KQ, stage, dsh, cbv_sh, ms_sh, acc);
    }

    // merge the warps' accumulators and write this split's partial result of every column
    B::write_partial(p, f0, ik2, i3, warp, sl, sr, tid, cvalid, acc, stage, M_sh, S_sh);
}

// merge the splits, add the sink, normalise, R^T (ISO V) and write dst[DV, n_head, N, ne3]; one warp per row
// (with 64-value blocks both half-warps compute the row, the lower one writes it)
template <int D, bool V_ISO>
__launch_bounds__(RQ_FA_NTHREADS, 1)
static __global__ void k_rq_fattn_combine(const float * __restrict__ part_vkq, const float2 * __restrict__ part_ms,
        const float * __restrict__ sinks, char * __restrict__ dst, const int nrows, const int nsplit,
        const int N, const int n_head, const int64_t nb1, const int64_t nb2, const int64_t nb3,
        const int variant, const bool unrotate) {
    constexpr int QK = D == 64 ? QK_ISO64 : QK_ISO;
    constexpr int NL = QK/4;
    constexpr int NB = D/QK;
    const int row = blockIdx.x*RQ_FA_NWARPS + threadIdx.y;
    if (row >= nrows) {
        return; // the whole warp
    }
    const int lane = threadIdx.x % NL;
    const bool store = threadIdx.x < NL;
    const int h    = row % n_head;
    const int t    = row / n_head;
    const int iq1  = t % N;
    const int i3   = t / N;

    float M = -INFINITY;
    for (int z = 0; z < nsplit; ++z) {
        M = fmaxf(M, part_ms[(int64_t) z*nrows + row].x);
    }
    const float sink = sinks ? sinks[h] : -INFINITY;
    const float Mf   = fmaxf(M, sink);

    float o[NB][4];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[b][e] = 0.0f;
        }
    }
    float S = 0.0f;
    if (Mf != -INFINITY) {
        for (int z = 0; z < nsplit; ++z) {
            const int64_t off = (int64_t) z*nrows + row;
            const float2  ms  = part_ms[off];
            if (ms.x == -INFINITY) {
                continue;
            }
            const float w = expf(ms.x - Mf);
            S += w*ms.y;
#pragma unroll
            for (int b = 0; b < NB; ++b) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    o[b][e] += w*part_vkq[off*D + b*QK + 4*lane + e];
                }
            }
        }
        if (sinks) {
            S += expf(sink - Mf);
        }
    }
    const float inv = S == 0.0f ? 0.0f : 1.0f/S;

    float * y = (float *) (dst + h*nb1 + iq1*nb2 + i3*nb3);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[b][e] *= inv;
        }
        if constexpr (V_ISO) {
            if (unrotate) {
                rq_iso_rotate_inv_warp<QK>(o[b], variant);
            }
        }
        if (store) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                y[b*QK + 4*lane + e] = o[b][e];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// host

static std::atomic<uint64_t> rq_fa_cuda_calls{0};

static bool rq_fa_other_type_ok(const ggml_tensor * t) {
    if (t->type == GGML_TYPE_F16) {
        return t->nb[1] % 4 == 0 && t->nb[2] % 4 == 0 && t->nb[3] % 4 == 0; // half2 loads
    }
    return t->type == GGML_TYPE_Q8_0;
}

bool ggml_rq_cuda_fattn_supported(int device, const ggml_tensor * dst) {
    GGML_UNUSED(device);
    const ggml_tensor * Q     = dst->src[0];
    const ggml_tensor * K     = dst->src[1];
    const ggml_tensor * V     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    const bool k_iso = ggml_rq_type_is_iso(K->type);
    const bool v_iso = ggml_rq_type_is_iso(V->type);
    if (!k_iso && !v_iso) {
        return false;
    }
    if (dst->src[5]) {
        return false; // exact F16 rows (the recent window, ggml_rq_flash_attn_ext_set_exact): CPU kernel only
    }
    if ((!k_iso && !rq_fa_other_type_ok(K)) || (!v_iso && !rq_fa_other_type_ok(V))) {
        return false;
    }
    // one block width for the op: 64-value blocks at head size 64, 128-value blocks at 128 and 256 (the
    // 64-wide types at other head sizes, or mixed block widths, go to the CPU)
    const int qk = ggml_rq_iso_qk(k_iso ? K->type : V->type);
    if (k_iso && v_iso && ggml_rq_iso_qk(V->type) != qk) {
        return false;
    }
    const int64_t D = K->ne[0];
    const bool d_ok = qk == QK_ISO64 ? D == 64 : D == 128 || D == 256;
    if (!d_ok || V->ne[0] != D || Q->ne[0] != D) {
        return false;
    }
    if (Q->type != GGML_TYPE_F32 || Q->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32) {
        return false;
    }
    if (K->ne[2] == 0 || Q->ne[2] % K->ne[2] != 0 || V->ne[2] != K->ne[2] || K->ne[1] != V->ne[1] ||
        K->ne[3] != Q->ne[3] || V->ne[3] != Q->ne[3]) {
        return false;
    }
    if (mask && (mask->type != GGML_TYPE_F16 || mask->ne[0] < K->ne[1] || mask->ne[1] < Q->ne[1] ||
                 Q->ne[2] % mask->ne[2] != 0 || Q->ne[3] % mask->ne[3] != 0)) {
        return false;
    }
    if (sinks && (sinks->type != GGML_TYPE_F32 || sinks->ne[0] < Q->ne[2])) {
        return false;
    }
    if (K->ne[1] >= INT32_MAX || Q->ne[1]*Q->ne[2]*Q->ne[3] >= INT32_MAX || K->ne[2]*K->ne[3] > 65535) {
        return false;
    }
    return true;
}

template <int D, int NC, int KB, int VB>
static void rq_fa_launch_main(const rq_fa_params & p, const dim3 grid, cudaStream_t stream) {
    k_rq_fattn<D, NC, KB, VB><<<grid, dim3(WARP_SIZE, RQ_FA_NWARPS, 1), 0, stream>>>(p);
}

// kb, vb: index widths of K and V (3, 4; 0 = not IsoQuant, at most one of them)
template <int D, int NC, int KB>
static void rq_fa_launch_v(const rq_fa_params & p, const int vb, const dim3 grid, cudaStream_t stream) {
    switch (vb) {
        case 0: if constexpr (KB != 0) { rq_fa_launch_main<D, NC, KB, 0>(p, grid, stream); return; } break;
        case 3: rq_fa_launch_main<D, NC, KB, 3>(p, grid, stream); return;
        case 4: rq_fa_launch_main<D, NC, KB, 4>(p, grid, stream); return;
    }
    GGML_ABORT("%s: K/V index widths %d/%d", __func__, KB, vb);
}

template <int D, int NC>
static void rq_fa_launch_kv(const rq_fa_params & p, const int kb, const int vb, const dim3 grid, cudaStream_t stream) {
    switch (kb) {
        case 0: rq_fa_launch_v<D, NC, 0>(p, vb, grid, stream); break;
        case 3: rq_fa_launch_v<D, NC, 3>(p, vb, grid, stream); break;
        case 4: rq_fa_launch_v<D, NC, 4>(p, vb, grid, stream); break;
        default: GGML_ABORT("%s: K index width %d", __func__, kb);
    }
}

template <int D>
static void rq_fa_launch_nc(const rq_fa_params & p, const int nc, const int kb, const int vb, const dim3 grid, cudaStream_t stream) {
    switch (nc) {
        case 1: rq_fa_launch_kv<D, 1>(p, kb, vb, grid, stream); break;
        case 4: rq_fa_launch_kv<D, 4>(p, kb, vb, grid, stream); break;
        case 8: rq_fa_launch_kv<D, 8>(p, kb, vb, grid, stream); break;
        default: GGML_ABORT("%s: %d columns", __func__, nc);
    }
}

void ggml_rq_cuda_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * Q     = dst->src[0];
    const ggml_tensor * K     = dst->src[1];
    const ggml_tensor * V     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    GGML_ASSERT(ggml_rq_cuda_fattn_supported(ctx.device, dst));

    const int  kb    = ggml_rq_iso_bits(K->type);
    const int  vb    = ggml_rq_iso_bits(V->type);
    const bool v_iso = vb != 0;
    const int  D     = (int) K->ne[0];

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));

    rq_fa_params p = {};
    p.Q    = (const char *) Q->data;
    p.K    = (const char *) K->data;
    p.V    = (const char *) V->data;
    p.mask = mask ? (const half *) mask->data : nullptr;
    p.nbq1 = Q->nb[1]; p.nbq2 = Q->nb[2]; p.nbq3 = Q->nb[3];
    p.nbk1 = K->nb[1]; p.nbk2 = K->nb[2]; p.nbk3 = K->nb[3];
    p.nbv1 = V->nb[1]; p.nbv2 = V->nb[2]; p.nbv3 = V->nb[3];
    if (mask) {
        p.nbm1  = mask->nb[1]; p.nbm2 = mask->nb[2]; p.nbm3 = mask->nb[3];
        p.ne_m2 = (int) mask->ne[2];
        p.ne_m3 = (int) mask->ne[3];
    } else {
        p.ne_m2 = 1;
        p.ne_m3 = 1;
    }
    p.N         = (int) Q->ne[1];
    p.n_head    = (int) Q->ne[2];
    p.n_head_kv = (int) K->ne[2];
    p.gqa       = p.n_head / p.n_head_kv;
    p.n_kv      = (int) K->ne[1];
    p.nrows     = (int) (Q->ne[1]*Q->ne[2]*Q->ne[3]);
    p.softcap   = softcap;
    p.scale     = softcap != 0.0f ? scale/softcap : scale;
    p.max_bias  = max_bias;
    p.n_head_log2 = 1 << (int) floorf(log2f((float) p.n_head));
    p.m0        = powf(2.0f, -(max_bias       )/p.n_head_log2);
    p.m1        = powf(2.0f, -(max_bias/2.0f)/p.n_head_log2);
    p.type_k    = K->type;
    p.type_v    = V->type;
    p.variant   = (int) ggml_rq_iso_get_variant();

    // columns per block, and KV splits until the grid covers the GPU about twice
    const int64_t ncols = (int64_t) p.N*p.gqa;
    const int     nc    = ncols <= 1 ? 1 : ncols <= 4 ? 4 : 8;
    const int64_t ntile = (ncols + nc - 1)/nc;
    const int64_t nbase = ntile*K->ne[2]*K->ne[3];
    const int64_t nkvt  = std::max<int64_t>(1, (p.n_kv + RQ_FA_TILE - 1)/RQ_FA_TILE);
    const int     nsm   = ggml_cuda_info().devices[ctx.device].nsm;
    int64_t nsplit = std::min<int64_t>(nkvt, std::max<int64_t>(1, (2*nsm + nbase - 1)/nbase));
    const int64_t tiles_per_split = (nkvt + nsplit - 1)/nsplit;
    nsplit     = (nkvt + tiles_per_split - 1)/tiles_per_split;
    p.kv_chunk = (int) (tiles_per_split*RQ_FA_TILE);
    GGML_ASSERT(ntile < INT32_MAX && nsplit <= 65535);

    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool_alloc<float>  part_vkq(ctx.pool(), (size_t) nsplit*p.nrows*D);
    ggml_cuda_pool_alloc<float2> part_ms (ctx.pool(), (size_t) nsplit*p.nrows);
    p.part_vkq = part_vkq.get();
    p.part_ms  = part_ms.get();

    const dim3 grid((unsigned) ntile, (unsigned) (K->ne[2]*K->ne[3]), (unsigned) nsplit);
    switch (D) {
        case  64: rq_fa_launch_nc< 64>(p, nc, kb, vb, grid, stream); break;
        case 128: rq_fa_launch_nc<128>(p, nc, kb, vb, grid, stream); break;
        default:  rq_fa_launch_nc<256>(p, nc, kb, vb, grid, stream); break;
    }

    const dim3 grid_c((unsigned) ((p.nrows + RQ_FA_NWARPS - 1)/RQ_FA_NWARPS), 1, 1);
    const dim3 block_c(WARP_SIZE, RQ_FA_NWARPS, 1);
    const bool unrotate = !ggml_rq_iso_get_skip_inverse();
    const float * sinks_d = sinks ? (const float *) sinks->data : nullptr;

#define RQ_COMBINE_ARGS p.part_vkq, p.part_ms, sinks_d, (char *) dst->data, p.nrows, (int) nsplit, p.N, p.n_head, \
    (int64_t) dst->nb[1], (int64_t) dst->nb[2], (int64_t) dst->nb[3], p.variant, unrotate

    if (D == 64) {
        if (v_iso) {
            k_rq_fattn_combine<64, true ><<<grid_c, block_c, 0, stream>>>(RQ_COMBINE_ARGS);
        } else {
            k_rq_fattn_combine<64, false><<<grid_c, block_c, 0, stream>>>(RQ_COMBINE_ARGS);
        }
    } else if (D == 128) {
        if (v_iso) {
            k_rq_fattn_combine<128, true ><<<grid_c, block_c, 0, stream>>>(RQ_COMBINE_ARGS);
        } else {
            k_rq_fattn_combine<128, false><<<grid_c, block_c, 0, stream>>>(RQ_COMBINE_ARGS);
        }
    } else {
        if (v_iso) {
            k_rq_fattn_combine<256, true ><<<grid_c, block_c, 0, stream>>>(RQ_COMBINE_ARGS);
        } else {
            k_rq_fattn_combine<256, false><<<grid_c, block_c, 0, stream>>>(RQ_COMBINE_ARGS);
        }
    }
#undef RQ_COMBINE_ARGS

    ggml_rq_counter_add(GGML_RQ_ISO_FUSED_CALLS, 1);
    rq_fa_cuda_calls.fetch_add(1, std::memory_order_relaxed);
}

uint64_t ggml_rq_cuda_fused_calls(void) {
    return rq_fa_cuda_calls.load(std::memory_order_relaxed);
}
