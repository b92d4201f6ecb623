// RotaryQuant CUDA: the device side of the fused IsoQuant flash attention (fattn-iso.cu): the launch
// shape (RQ_FA_*), the kernel parameters (rq_fa_params), staging packed K/V rows in shared memory
// (rq_fa_stage, rq_idx, rq_fa_lane_bits, rq_fa_load) and the stages of k_rq_fattn (rq_fa_block:
// load_q, score, softmax, accumulate, write_partial). See fattn-iso.cu for the algorithm and the grid.
// Included by fattn-iso.cu only; everything here is static or a template.
#pragma once

#include "rq-impl.cuh"
#include "rq-device.cuh"

#define RQ_FA_NWARPS   4
#define RQ_FA_NTHREADS (RQ_FA_NWARPS*WARP_SIZE)
#define RQ_FA_TILE     RQ_FA_NTHREADS // KV rows per tile: one per thread when scoring

struct rq_fa_params {
    const char  * Q;
    const char  * K;
    const char  * V;
    const half  * mask;
    float       * part_vkq; // [nsplit][nrows][D]: un-normalised accumulators (rotated domain for IsoQuant V)
    float2      * part_ms;  // [nsplit][nrows]: (max, sum)

    int64_t nbq1, nbq2, nbq3;
    int64_t nbk1, nbk2, nbk3;
    int64_t nbv1, nbv2, nbv3;
    int64_t nbm1, nbm2, nbm3;
    int     ne_m2, ne_m3;

    int     N;         // query rows per head
    int     n_head;
    int     gqa;       // n_head / n_head_kv
    int     n_head_kv;
    int     n_kv;
    int     kv_chunk;  // KV rows per split, a multiple of RQ_FA_TILE
    int     nrows;     // N * n_head * ne3 output rows

    float   scale;     // scale / softcap when softcap != 0 (folded into Q)
    float   softcap;
    float   max_bias, m0, m1;
    int     n_head_log2;

    int     type_k;    // the non-ISO side: F16 or Q8_0
    int     type_v;
    int     variant;   // ggml_rq_iso_variant of the rotation applied to Q
};

// ---------------------------------------------------------------------------------------------
// device pieces

// copy the packed IsoQuant rows kv0.. of one head into shared memory: per row and QK-block the QK*BITS/8
// index bytes as QK*BITS/32 words (row stride SW words, odd, so that per-row reads are conflict free) and
// the scale
template <int NB, int SW, int BITS, int QK>
static __device__ __forceinline__ void rq_fa_stage(const char * __restrict__ base, const int64_t nb1, const int kv0, const int kv_end,
                                                   uint32_t * __restrict__ stage, float * __restrict__ dsh) {
    constexpr int HPB = 1 + QK*BITS/16; // 16-bit words per block: d, then the indices
    const int lane = threadIdx.x;
    for (int r = threadIdx.y; r < RQ_FA_TILE; r += RQ_FA_NWARPS) {
        const int kv = kv0 + r;
        if (kv >= kv_end) {
            break;
        }
        const uint16_t * src = (const uint16_t *) (base + (int64_t) kv*nb1);
        uint16_t * dst16 = (uint16_t *) (stage + r*SW);
        for (int u = lane; u < NB*HPB; u += WARP_SIZE) {
            const int b = u / HPB;
            const int k = u - HPB*b;
            const uint16_t val = src[u];
            if (k == 0) {
                dsh[r*NB + b] = __half2float(__ushort_as_half(val));
            } else {
                dst16[(HPB - 1)*b + k - 1] = val;
            }
        }
    }
}

// index k (0..31) of 32 consecutive BITS-bit indices packed in w[0..BITS-1]
template <int BITS>
static __device__ __forceinline__ int rq_idx(const uint32_t w[BITS], const int k) {
    const int bit = BITS*k;
    const int wi  = bit >> 5;
    const int sh  = bit & 31;
    uint32_t v = w[wi] >> sh;
    if (sh > 32 - BITS) {
        v |= w[wi + 1] << (32 - sh);
    }
    return v & ((1u << BITS) - 1);
}

// the 4*BITS index bits of values 4*lane..4*lane+3 of one staged block (words wb[0..QK*BITS/32-1])
template <int BITS>
static __device__ __forceinline__ uint32_t rq_fa_lane_bits(const uint32_t * wb, const int lane) {
    const int bit = 4*BITS*lane;
    const int wi  = bit >> 5;
    const int sh  = bit & 31;
    uint32_t bits = wb[wi] >> sh;
    if (sh > 32 - 4*BITS) {
        bits |= wb[wi + 1] << (32 - sh);
    }
    return bits;
}

// one element of a non-ISO K/V row
static __device__ __forceinline__ float rq_fa_load(const char * __restrict__ row, const int type, const int i) {
    if (type == GGML_TYPE_F16) {
        return __half2float(((const half *) row)[i]);
    }
    const block_q8_0 * b = (const block_q8_0 *) row + i/QK8_0;
    return __half2float(b->d)*(float) b->qs[i % QK8_0];
}

// the stages of k_rq_fattn (steps 0-4 above and the partial write); the shape of one instance
template <int D, int NC, int KB, int VB>
struct rq_fa_block {
    static constexpr bool K_ISO = KB != 0;
    static constexpr bool V_ISO = VB != 0;
    static constexpr int  QK  = D == 64 ? QK_ISO64 : QK_ISO; // IsoQuant block width
    static constexpr int  NL  = QK/4;       // lanes per block (one SO(4) group each): 32 or 16
    static constexpr int  RPW = WARP_SIZE/NL; // KV rows a warp accumulates at once: 1, or 2 (one per half-warp)
    static constexpr int  NB  = D/QK;       // blocks per row
    static constexpr int  NCH = QK/32;      // 32-index chunks per block
    static constexpr int  EPL = 4*NB;       // accumulator values per lane and column
    static constexpr int  KW  = NCH*KB;     // staged index words per K block (12 or 16; 6 or 8 for 64-value blocks)
    static constexpr int  VW  = NCH*VB;
    static constexpr int  SW  = NCH*(KB > VB ? KB : VB)*NB + 1;  // staged words per row (K and V share the buffer)
    static_assert(D % QK == 0 && (D == 64) == (QK == QK_ISO64), "head size and block width");

    // 0. Q * scale, rotated by R for ISO K (once per column and block; with 64-value blocks both half-warps
    //    compute the same block, the lower one stores it)
    static __device__ __forceinline__ void load_q(const rq_fa_params & p, const int f0, const int ik2, const int i3,
                                                  const int ncols_total, const int warp, const int sl, const int sr,
                                                  float (&Qs)[NC][D]) {
        for (int c = warp; c < NC; c += RQ_FA_NWARPS) {
            const int  f     = f0 + c;
            const bool valid = f < ncols_total;
            const int  iq1   = valid ? f / p.gqa : 0;
            const int  h     = ik2*p.gqa + (valid ? f % p.gqa : 0);
            const float * q  = (const float *) (p.Q + iq1*p.nbq1 + h*p.nbq2 + i3*p.nbq3);
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                float v[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
                if (valid) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        v[e] = q[b*QK + 4*sl + e]*p.scale;
                    }
                }
                if constexpr (K_ISO) {
                    rq_iso_rotate_warp<QK>(v, p.variant);
                }
                if (sr == 0) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        Qs[c][b*QK + 4*sl + e] = v[e];
                    }
                }
            }
        }
    }

    // 2. the scores of KV row kv, thread tid's, against all NC columns: ISO K from its staged row and the codebook,
    //    F16/Q8_0 K from global memory; softcap, then mv (mask and ALiBi); -INFINITY where masked
    static __device__ __forceinline__ void score(const rq_fa_params & p, const char * K, const int kv, const int tid,
                                                 const bool row_any, const float (&mv)[NC], const uint32_t * stage,
                                                 const float * dsh, const float (&Qs)[NC][D], const float * cbk_sh,
                                                 float (&s)[NC]) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            s[c] = -INFINITY;
        }
        if (row_any) {
            float dot[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                dot[c] = 0.0f;
            }
            if constexpr (K_ISO) {
                const uint32_t * wrow = stage + tid*SW;
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    float db[NC];
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        db[c] = 0.0f;
                    }
#pragma unroll
                    for (int ch = 0; ch < NCH; ++ch) {
                        uint32_t w[KB];
#pragma unroll
                        for (int i = 0; i < KB; ++i) {
                            w[i] = wrow[KW*b + KB*ch + i];
                        }
#pragma unroll
                        for (int k = 0; k < 32; k += 4) {
                            const float c0 = cbk_sh[rq_idx<KB>(w, k + 0)];
                            const float c1 = cbk_sh[rq_idx<KB>(w, k + 1)];
                            const float c2 = cbk_sh[rq_idx<KB>(w, k + 2)];
                            const float c3 = cbk_sh[rq_idx<KB>(w, k + 3)];
#pragma unroll
                            for (int c = 0; c < NC; ++c) {
                                const float4 q4 = *(const float4 *) &Qs[c][b*QK + 32*ch + k];
                                db[c] += c0*q4.x + c1*q4.y + c2*q4.z + c3*q4.w;
                            }
                        }
                    }
                    const float dk = dsh[tid*NB + b];
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        dot[c] += dk*db[c];
                    }
                }
            } else {
                const char * krow = K + (int64_t) kv*p.nbk1;
                if (p.type_k == GGML_TYPE_F16) {
                    const half2 * k2 = (const half2 *) krow;
#pragma unroll 4
                    for (int i = 0; i < D/2; ++i) {
                        const float2 kf = __half22float2(k2[i]);
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            dot[c] += kf.x*Qs[c][2*i] + kf.y*Qs[c][2*i + 1];
                        }
                    }
                } else {
                    const block_q8_0 * kb = (const block_q8_0 *) krow;
                    for (int ib = 0; ib < D/QK8_0; ++ib) {
                        float db[NC];
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            db[c] = 0.0f;
                        }
#pragma unroll 8
                        for (int j = 0; j < QK8_0; ++j) {
                            const float kq = (float) kb[ib].qs[j];
#pragma unroll
                            for (int c = 0; c < NC; ++c) {
                                db[c] += kq*Qs[c][ib*QK8_0 + j];
                            }
                        }
                        const float dk = __half2float(kb[ib].d);
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            dot[c] += dk*db[c];
                        }
                    }
                }
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                float x = dot[c];
                if (p.softcap != 0.0f) {
                    x = p.softcap*tanhf(x);
                }
                s[c] = mv[c] == -INFINITY ? -INFINITY : x + mv[c];
            }
        }
    }

    // 3. online softmax of the tile's scores KQ, one warp per column: KQ becomes the probabilities, M_sh and S_sh
    //    the running max and sum, ms_sh the factor that rescales the column's accumulator
    static __device__ __forceinline__ void softmax(const int warp, const int lane, float (&KQ)[RQ_FA_TILE][NC],
                                                   float (&M_sh)[NC], float (&S_sh)[NC], float (&ms_sh)[NC]) {
        for (int c = warp; c < NC; c += RQ_FA_NWARPS) {
            float mx = -INFINITY;
            for (int r = lane; r < RQ_FA_TILE; r += WARP_SIZE) {
                mx = fmaxf(mx, KQ[r][c]);
            }
            mx = warp_reduce_max(mx);
            const float Mold = M_sh[c];
            const float Mnew = fmaxf(Mold, mx);
            float ms  = 1.0f;
            float sum = 0.0f;
            if (Mnew == -INFINITY) {
                for (int r = lane; r < RQ_FA_TILE; r += WARP_SIZE) {
                    KQ[r][c] = 0.0f;
                }
            } else {
                ms = Mold == -INFINITY ? 0.0f : expf(Mold - Mnew);
                for (int r = lane; r < RQ_FA_TILE; r += WARP_SIZE) {
                    const float x  = KQ[r][c];
                    const float pr = x == -INFINITY ? 0.0f : expf(x - Mnew);
                    KQ[r][c] = pr;
                    sum += pr;
                }
            }
            sum = warp_reduce_sum(sum);
            if (lane == 0) {
                M_sh[c]  = Mnew;
                S_sh[c]  = S_sh[c]*ms + sum;
                ms_sh[c] = ms;
            }
        }
    }

    // 4. accumulate p * V of the tile kv0.. (rotated domain for ISO V; V staged for ISO V, else from global memory)
    static __device__ __forceinline__ void accumulate(const rq_fa_params & p, const char * V, const int kv0, const int kv_end,
                                                      const int warp, const int sl, const int sr,
                                                      const float (&KQ)[RQ_FA_TILE][NC], const uint32_t * stage,
                                                      const float * dsh, const float * cbv_sh, const float (&ms_sh)[NC],
                                                      float (&acc)[NC][EPL]) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float ms = ms_sh[c];
#pragma unroll
            for (int k = 0; k < EPL; ++k) {
                acc[c][k] *= ms;
            }
        }
        for (int r = warp*RPW + sr; r < RQ_FA_TILE && kv0 + r < kv_end; r += RQ_FA_NWARPS*RPW) {
            float pr[NC];
            bool  nz = false;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                pr[c] = KQ[r][c];
                nz = nz || pr[c] != 0.0f;
            }
            if (!nz) {
                continue; // masked for every column (same r for the whole lane group; no shuffles below)
            }
            if constexpr (V_ISO) {
                const uint32_t * wrow = stage + r*SW;
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const uint32_t bits = rq_fa_lane_bits<VB>(wrow + VW*b, sl);
                    const float dv = dsh[r*NB + b];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float val = dv*cbv_sh[(bits >> (VB*e)) & ((1u << VB) - 1)];
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            acc[c][4*b + e] += pr[c]*val;
                        }
                    }
                }
            } else {
                const char * vrow = V + (int64_t) (kv0 + r)*p.nbv1;
#pragma unroll
                for (int b = 0; b < NB; ++b) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float val = rq_fa_load(vrow, p.type_v, b*QK + 4*sl + e);
#pragma unroll
                        for (int c = 0; c < NC; ++c) {
                            acc[c][4*b + e] += pr[c]*val;
                        }
                    }
                }
            }
        }
    }

    // merge the 4 warps' (8 half-warps') accumulators and write this split's partial result of every column, with
    // stage as the buffer; every thread of the block calls it (barriers; the valid columns are the block's)
    static __device__ __forceinline__ void write_partial(const rq_fa_params & p, const int f0, const int ik2, const int i3,
                                                         const int warp, const int sl, const int sr, const int tid,
                                                         const bool (&cvalid)[NC], const float (&acc)[NC][EPL],
                                                         uint32_t * stage, const float (&M_sh)[NC], const float (&S_sh)[NC]) {
        __syncthreads();
        constexpr int NPART = RQ_FA_NWARPS*RPW;
        float * red = (float *) stage; // [NPART][D]
        static_assert(RQ_FA_TILE*SW >= NPART*D, "reduction buffer too small");
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (!cvalid[c]) {
                break; // valid columns come first
            }
            const int f   = f0 + c;
            const int iq1 = f / p.gqa;
            const int h   = ik2*p.gqa + f % p.gqa;
            const int64_t row = ((int64_t) i3*p.N + iq1)*p.n_head + h;
            const int64_t off = (int64_t) blockIdx.z*p.nrows + row;
#pragma unroll
            for (int b = 0; b < NB; ++b) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    red[(warp*RPW + sr)*D + b*QK + 4*sl + e] = acc[c][4*b + e];
                }
            }
            __syncthreads();
            for (int i = tid; i < D; i += RQ_FA_NTHREADS) {
                float sum = 0.0f;
#pragma unroll
                for (int w = 0; w < NPART; ++w) {
                    sum += red[w*D + i];
                }
                p.part_vkq[off*D + i] = sum;
            }
            if (tid == 0) {
                p.part_ms[off] = make_float2(M_sh[c], S_sh[c]);
            }
            __syncthreads();
        }
    }
};
