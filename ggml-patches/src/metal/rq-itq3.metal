// RotaryQuant ITQ3_S on Metal: GET_ROWS (dequantise) and the matrix products (MUL_MAT, MUL_MAT_ID) on rotated
// activations, in ggml-metal's style. A 256-weight block is 3-bit codes on a shared grid in the Walsh-Hadamard domain:
// w = S * FWHT256(d*grid[q] + m) (S: the fixed signs, FWHT256 normalised by 1/16). On a simdgroup lane l holds block
// values 8l..8l+7: the butterflies h = 1, 2, 4 stay in the lane, h = 8 .. 128 pair lane l with lane l ^ h/8.
// The products never dequantise: <w, x> = <d*grid[q] + m, FWHT256(S*x)>, so each activation block is rotated once per
// threadgroup and every row dots its codes against it (F32 activations; the CPU's Q8_ITQ codes are a CPU choice).
//
// Never compiled by Apple's compiler here: tests/metal runs this source as C++ under an emulation of threadgroups,
// simdgroups and barriers, against ggml's C reference.

#include <metal_stdlib>
#include "ggml-metal-impl.h"
#include "rq-itq3-tables.h"

using namespace metal;

#ifndef N_SIMDWIDTH
#define N_SIMDWIDTH 32
#endif

#define QK_ITQ 256

typedef struct {
    half    d;
    half    m;
    uint8_t qs[QK_ITQ/4];
    uint8_t qh[QK_ITQ/8];
} block_itq3_s;
static_assert(sizeof(block_itq3_s) == 4 + QK_ITQ/4 + QK_ITQ/8, "wrong itq3_s block size/padding");

// code of value i: low 2 bits in qs[i & 63] at 2*(i >> 6), high bit in qh[i & 31] at i >> 5
static inline short rq_itq3_code(device const block_itq3_s * x, short i) {
    return ((x->qs[i & 63] >> (2*(i >> 6))) & 3) | (((x->qh[i & 31] >> (i >> 5)) & 1) << 2);
}

// the unnormalised WHT-256 of the 8 values v[0..7] = block values 8*lane + 0..7
static inline void rq_itq3_wht(thread float * v, ushort lane) {
    for (short h = 1; h < 8; h <<= 1) {
        for (short i = 0; i < 8; i += 2*h) {
            for (short j = i; j < i + h; ++j) {
                const float a = v[j], b = v[j + h];
                v[j]     = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (ushort h = 1; h < N_SIMDWIDTH; h <<= 1) {
        for (short j = 0; j < 8; ++j) {
#if defined(RQ_MTL_BREAK_SHUFFLE)
            const float o = simd_shuffle_xor(v[j], (ushort) (h == 4 ? 5 : h)); // deliberately wrong partner
#else
            const float o = simd_shuffle_xor(v[j], h);
#endif
            v[j] = (lane & h) ? o - v[j] : v[j] + o;
        }
    }
}

// GET_ROWS on upstream's kernel_get_rows_q grid: threadgroup (i10, i11, i12), one simdgroup per row
kernel void kernel_get_rows_itq3_s(
        constant ggml_metal_kargs_get_rows & args,
        device const void * src0,
        device const void * src1,
        device       void * dst,
        uint3               tgpig[[threadgroup_position_in_grid]],
        ushort              tiisg[[thread_index_in_simdgroup]]) {
    const int32_t i10 = tgpig.x;
    const int32_t i11 = tgpig.y;
    const int32_t i12 = tgpig.z;

    const int32_t r = ((const device int32_t *) ((const device char *) src1 + i12*args.nb12 + i11*args.nb11 + i10*args.nb10))[0];

    device const block_itq3_s * x = (device const block_itq3_s *) ((device const char *) src0 + i12*args.nb03 + i11*args.nb02 + r*args.nb01);
    device       float        * y = (device float *) ((device char *) dst + i12*args.nb3 + i11*args.nb2 + i10*args.nb1);

    for (int ib = 0; ib < args.ne00/QK_ITQ; ++ib) {
        const float d = (float) x[ib].d;
        const float m = (float) x[ib].m;
        float v[8];
        for (short k = 0; k < 8; ++k) {
            v[k] = d*(float) itq3_grid[rq_itq3_code(x + ib, 8*tiisg + k)] + m;
        }
        rq_itq3_wht(v, tiisg);
        for (short k = 0; k < 8; ++k) {
            y[ib*QK_ITQ + 8*tiisg + k] = (v[k]*0.0625f)*itq3_signs[8*tiisg + k];
        }
    }
}

// dst = W X for F32 activations: threadgroup (row group, column group, i12/i13) of NSG simdgroups, each taking NR
// consecutive rows, against NC consecutive columns. The columns' rotated blocks go through threadgroup memory CH
// blocks at a time (CH*NC KiB; Metal allows 32 KiB), rotated by the simdgroups in turn, each row decoding its codes
// once per block for all NC columns. NC = 1 is the matrix-vector product, NC = 8 the matrix-matrix one; a column's
// result does not depend on NC (same operations, same order), so the two are bit-identical
template <short NSG, short NR, short NC, short CH>
static inline void rq_mul_mv_itq3_s_impl(
        ggml_metal_kargs_mul_mv args,   // by value: MUL_MAT_ID passes its own (thread) copy
        device const char * src0,
        device const char * src1,
        device       char * dst,
        threadgroup float * shmem,
        uint3  tgpig,
        ushort tiisg,
        ushort sgitg) {
    const int nb  = args.ne00/QK_ITQ;
    const int i1b = tgpig.y*NC;                  // this threadgroup's first column
    const int i12 = tgpig.z%args.ne12;
    const int i13 = tgpig.z/args.ne12;
    const int i02 = i12/args.r2;
    const int i03 = i13/args.r3;
    const int r0  = (tgpig.x*NSG + sgitg)*NR;   // this simdgroup's first row
    const int nc  = min((int) NC, args.ne11 - i1b);

    device const float * x = (device const float *) (src1 + i1b*args.nb11 + i12*args.nb12 + i13*args.nb13);

    float sums[NR][NC];
    for (short ir = 0; ir < NR; ++ir) {
        for (short ic = 0; ic < NC; ++ic) {
            sums[ir][ic] = 0.0f;
        }
    }
    for (int c0 = 0; c0 < nb; c0 += CH) {
        const int c1 = min(nb, c0 + CH);
        for (int p = sgitg; p < (c1 - c0)*nc; p += NSG) {
            const int ib = c0 + p/nc;
            const int ic = p%nc;
            device const float * xc = (device const float *) ((device const char *) x + ic*args.nb11);
            float v[8];
            for (short k = 0; k < 8; ++k) {
                v[k] = xc[ib*QK_ITQ + 8*tiisg + k]*itq3_signs[8*tiisg + k];
            }
            rq_itq3_wht(v, tiisg);
            for (short k = 0; k < 8; ++k) {
                shmem[((ib - c0)*NC + ic)*QK_ITQ + 8*tiisg + k] = v[k]*0.0625f;
            }
        }
#if !defined(RQ_MTL_BREAK_BARRIER)
        threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
        for (short ir = 0; ir < NR && r0 + ir < args.ne01; ++ir) {
            device const block_itq3_s * w = (device const block_itq3_s *) (src0 + (r0 + ir)*args.nb01 + i02*args.nb02 + i03*args.nb03);
            for (int ib = c0; ib < c1; ++ib) {
                const float d = (float) w[ib].d;
                const float m = (float) w[ib].m;
                float wv[8];
                for (short k = 0; k < 8; ++k) {
                    wv[k] = d*(float) itq3_grid[rq_itq3_code(w + ib, 8*tiisg + k)] + m;
                }
                for (short ic = 0; ic < nc; ++ic) {
                    threadgroup const float * xr = shmem + ((ib - c0)*NC + ic)*QK_ITQ + 8*tiisg;
                    for (short k = 0; k < 8; ++k) {
                        sums[ir][ic] += wv[k]*xr[k];
                    }
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // the next chunk overwrites shmem
    }

    device float * y = (device float *) dst + (int64_t) i13*args.ne0*args.ne1*args.ne12 + (int64_t) i12*args.ne0*args.ne1;
    for (short ir = 0; ir < NR && r0 + ir < args.ne01; ++ir) {
        for (short ic = 0; ic < nc; ++ic) {
            const float sum = simd_sum(sums[ir][ic]);
            if (tiisg == 0) {
                y[(int64_t) (i1b + ic)*args.ne0 + r0 + ir] = sum;
            }
        }
    }
}

template <short NSG, short NR, short NC, short CH>
kernel void kernel_mul_mv_itq3_s_f32(
        constant ggml_metal_kargs_mul_mv & args,
        device const char * src0,
        device const char * src1,
        device       char * dst,
        threadgroup float * shmem [[threadgroup(0)]],
        uint3  tgpig[[threadgroup_position_in_grid]],
        ushort tiisg[[thread_index_in_simdgroup]],
        ushort sgitg[[simdgroup_index_in_threadgroup]]) {
    rq_mul_mv_itq3_s_impl<NSG, NR, NC, CH>(args, src0, src1, dst, shmem, tgpig, tiisg, sgitg);
}

// MUL_MAT_ID (mixture-of-experts) on upstream's kernel_mul_mv_id grid: z = (token, expert slot), the slot's expert
// chosen from ids, then the matrix-vector product of that expert and that token's activation row
template <short NSG, short NR, short CH>
kernel void kernel_mul_mv_id_itq3_s_f32(
        constant ggml_metal_kargs_mul_mv_id & args,
        device const char * src0s,
        device const char * src1,
        device       char * dst,
        device const char * ids,
        threadgroup float * shmem [[threadgroup(0)]],
        uint3  tgpig[[threadgroup_position_in_grid]],
        ushort tiisg[[thread_index_in_simdgroup]],
        ushort sgitg[[simdgroup_index_in_threadgroup]]) {
    const int iid1 = tgpig.z/args.nei0;   // token
    const int idx  = tgpig.z%args.nei0;   // expert slot
    const int32_t i02 = ((device const int32_t *) (ids + iid1*args.nbi1))[idx];
    const int64_t i11 = idx % args.ne11;

    ggml_metal_kargs_mul_mv args0 = {
        /*.ne00 =*/ args.ne00, /*.ne01 =*/ args.ne01, /*.ne02 =*/ 1,
        /*.nb00 =*/ args.nb00, /*.nb01 =*/ args.nb01, /*.nb02 =*/ args.nb02, /*.nb03 =*/ args.nb02,
        /*.ne10 =*/ args.ne10, /*.ne11 =*/ 1, /*.ne12 =*/ 1,
        /*.nb10 =*/ args.nb10, /*.nb11 =*/ args.nb11, /*.nb12 =*/ args.nb12, /*.nb13 =*/ args.nb12,
        /*.ne0  =*/ args.ne0, /*.ne1 =*/ 1, /*.nr0 =*/ NR, /*.r2 =*/ 1, /*.r3 =*/ 1,
    };
    rq_mul_mv_itq3_s_impl<NSG, NR, 1, CH>(args0, src0s + i02*args.nb02, src1 + i11*args.nb11 + iid1*args.nb12,
        dst + (idx*args.ne0 + (int64_t) iid1*args.ne1*args.ne0)*sizeof(float), shmem, uint3(tgpig.x, 0, 0), tiisg, sgitg);
}

typedef decltype(kernel_mul_mv_itq3_s_f32<4, 2, 1, 16>) mul_mv_itq3_t;
typedef decltype(kernel_mul_mv_id_itq3_s_f32<4, 2, 16>) mul_mv_id_itq3_t;

template [[host_name("kernel_mul_mv_itq3_s_f32")]]    kernel mul_mv_itq3_t    kernel_mul_mv_itq3_s_f32<4, 2, 1, 16>;
template [[host_name("kernel_mul_mm_itq3_s_f32")]]    kernel mul_mv_itq3_t    kernel_mul_mv_itq3_s_f32<4, 4, 8, 2>;
template [[host_name("kernel_mul_mv_id_itq3_s_f32")]] kernel mul_mv_id_itq3_t kernel_mul_mv_id_itq3_s_f32<4, 2, 16>;
