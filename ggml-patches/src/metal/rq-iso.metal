// RotaryQuant IsoQuant on Metal: GET_ROWS, SET_ROWS and CPY (F32 -> type, type -> F32/F16) of the four IsoQuant
// types, in ggml-metal's style (kernels/quantize.metal).
//
// Never compiled by Apple's compiler here: tests/metal runs this source as C++ under an emulation of threadgroups,
// simdgroups and barriers (tests/metal/shim), which checks logic, indexing and layout, not Apple's compiler or speed.

#include "rq-iso.h"

// one row of nb blocks to T (float, half): all lanes stage a block's bytes in threadgroup memory, the first QK/4
// lanes decode it (lane l: values 4l..4l+3) and rotate it back
template <typename block_q, short BITS, short QK, typename T>
static inline void rq_iso_dequant_row(device const uchar * psrc, device T * pdst, int nb, threadgroup uchar * shmem, ushort tiisg) {
    for (int ib = 0; ib < nb; ++ib) {
        device const uchar * blk = psrc + ib*sizeof(block_q);
        for (ushort i = tiisg; i < sizeof(block_q); i += N_SIMDWIDTH) {
            shmem[i] = blk[i];
        }
#if !defined(RQ_MTL_BREAK_BARRIER)
        threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
        if (tiisg < QK/4) {
            const float d = (float) ((threadgroup const block_q *) shmem)->d;
            const float4 y = rq_iso_codes<BITS, QK>(shmem + sizeof(half), tiisg, d);
            const float4 x = rq_iso_rotate_inv<QK>(y, tiisg);
            for (short k = 0; k < 4; ++k) {
                pdst[ib*QK + 4*tiisg + k] = (T) x[k];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup); // the next block overwrites shmem
    }
}

// GET_ROWS on the grid of upstream's kernel_get_rows_q: threadgroup (i10 + ne10*iw0, i11, i12), here one simdgroup
// per row (iw0 = 0) that walks the row's blocks
template <typename block_q, short BITS, short QK>
kernel void kernel_get_rows_iso(
        constant ggml_metal_kargs_get_rows & args,
        device const void * src0,
        device const void * src1,
        device       void * dst,
        threadgroup uchar * shmem [[threadgroup(0)]],
        uint3               tgpig[[threadgroup_position_in_grid]],
        ushort              tiisg[[thread_index_in_simdgroup]]) {
    const int32_t i10 = tgpig.x;
    const int32_t i11 = tgpig.y;
    const int32_t i12 = tgpig.z;

    const int32_t r = ((const device int32_t *) ((const device char *) src1 + i12*args.nb12 + i11*args.nb11 + i10*args.nb10))[0];

    device const uchar * psrc = (device const uchar *) src0 + i12*args.nb03 + i11*args.nb02 + r*args.nb01;
    device       float * pdst = (device float *) ((device char *) dst + i12*args.nb3 + i11*args.nb2 + i10*args.nb1);

    rq_iso_dequant_row<block_q, BITS, QK, float>(psrc, pdst, args.ne00/QK, shmem, tiisg);
}

typedef decltype(kernel_get_rows_iso<block_isoquant3_0, 3, QK_ISO>) get_rows_iso_t;

template [[host_name("kernel_get_rows_isoquant3_0")]]  kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant3_0,  3, QK_ISO>;
template [[host_name("kernel_get_rows_isoquant4_0")]]  kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant4_0,  4, QK_ISO>;
template [[host_name("kernel_get_rows_isoquant3_64")]] kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant3_64, 3, QK_ISO64>;
template [[host_name("kernel_get_rows_isoquant4_64")]] kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant4_64, 4, QK_ISO64>;

// SET_ROWS (the KV cache write) on upstream's kernel_set_rows_q arguments: threadgroup (i01, i02, i03), one simdgroup
// per source row, walking its blocks. The C reference normalises in float64 (a fixed tree of squares, then x/sd
// rounded once); Metal has no double, so the norm is a float simd_sum and the division is in float: a value within
// an ulp of a codebook boundary may take the neighbouring index, and d may differ in its last fp16 bit (tests/metal
// measures how often).
// one row of nb blocks of F32 values to block_q, one simdgroup
template <typename block_q, short BITS, short QK>
static inline void rq_iso_quant_row(device const float * src_row, device block_q * dst_row, int nb, ushort tiisg) {
    constant const float * cb  = QK == QK_ISO ? (BITS == 3 ? iq3_codebook : iq4_codebook)
                                              : (BITS == 3 ? iq3_64_codebook : iq4_64_codebook);
    constant const float * bnd = QK == QK_ISO ? (BITS == 3 ? iq3_bounds : iq4_bounds)
                                              : (BITS == 3 ? iq3_64_bounds : iq4_64_bounds);
    constexpr short NBND = (1 << BITS) - 1;

    const bool   lane_on = tiisg < QK/4;
    const ushort lane    = lane_on ? tiisg : 0;

    for (int ib = 0; ib < nb; ++ib) {
        float4 x;
        for (short c = 0; c < 4; ++c) {
            x[c] = src_row[ib*QK + 4*lane + c];
        }
        const float sd = sqrt(simd_sum(lane_on ? dot(x, x) : 0.0f));
        const float4 xh = sd > 0.0f ? x/sd : float4(0.0f);
        const float4 y  = rq_iso_rotate<QK>(xh, lane);

        uint  w = 0;
        float4 c4;
        for (short k = 0; k < 4; ++k) {
            short idx = 0;   // #{b : y > bounds[b]} (strict; a NaN gives 0)
            for (short b = 0; b < NBND; ++b) {
                idx += y[k] > bnd[b];
            }
            c4[k] = cb[idx];
            w |= (uint) idx << (BITS*(4*(lane & 1) + k));
        }
        // the group of 8 indices is lanes 2g and 2g+1: the even lane writes its BITS bytes
        w |= simd_shuffle_xor(w, (ushort) 1);
        const float cc = simd_sum(lane_on ? dot(c4, c4) : 0.0f);
        if (lane_on && (lane & 1) == 0) {
            for (short b = 0; b < BITS; ++b) {
                dst_row[ib].qs[BITS*(lane/2) + b] = (uchar) ((w >> (8*b)) & 0xff);
            }
        }
        if (tiisg == 0) {
            const float dd = sd/sqrt(cc);   // the codebooks have no zero level: cc > 0
            dst_row[ib].d = (half) (dd < 65504.0f ? dd : 65504.0f);
        }
    }
}

template <typename TI, typename block_q, short BITS, short QK>
kernel void kernel_set_rows_iso(
        constant ggml_metal_kargs_set_rows & args,
        device const  void * src0,
        device const  void * src1,
        device       float * dst,
        uint3                tgpig[[threadgroup_position_in_grid]],
        ushort               tiisg[[thread_index_in_simdgroup]]) {
    const int32_t i01 = tgpig.x;
    const int32_t i02 = tgpig.y;
    const int32_t i03 = tgpig.z;
    const int32_t i12 = i03%args.ne12;
    const int32_t i11 = i02%args.ne11;

    const TI i1 = ((const device TI *) ((const device char *) src1 + i01*args.nb10 + i11*args.nb11 + i12*args.nb12))[0];

    device       block_q * dst_row = (device block_q *) ((device char *) dst + i1*args.nb1 + i02*args.nb2 + i03*args.nb3);
    device const float   * src_row = (device const float *) ((device const char *) src0 + i01*args.nb01 + i02*args.nb02 + i03*args.nb03);

    rq_iso_quant_row<block_q, BITS, QK>(src_row, dst_row, args.nk0, tiisg);
}

typedef decltype(kernel_set_rows_iso<int64_t, block_isoquant3_0, 3, QK_ISO>) set_rows_iso_t;

template [[host_name("kernel_set_rows_isoquant3_0_i64")]]  kernel set_rows_iso_t kernel_set_rows_iso<int64_t, block_isoquant3_0,  3, QK_ISO>;
template [[host_name("kernel_set_rows_isoquant3_0_i32")]]  kernel set_rows_iso_t kernel_set_rows_iso<int32_t, block_isoquant3_0,  3, QK_ISO>;
template [[host_name("kernel_set_rows_isoquant4_0_i64")]]  kernel set_rows_iso_t kernel_set_rows_iso<int64_t, block_isoquant4_0,  4, QK_ISO>;
template [[host_name("kernel_set_rows_isoquant4_0_i32")]]  kernel set_rows_iso_t kernel_set_rows_iso<int32_t, block_isoquant4_0,  4, QK_ISO>;
template [[host_name("kernel_set_rows_isoquant3_64_i64")]] kernel set_rows_iso_t kernel_set_rows_iso<int64_t, block_isoquant3_64, 3, QK_ISO64>;
template [[host_name("kernel_set_rows_isoquant3_64_i32")]] kernel set_rows_iso_t kernel_set_rows_iso<int32_t, block_isoquant3_64, 3, QK_ISO64>;
template [[host_name("kernel_set_rows_isoquant4_64_i64")]] kernel set_rows_iso_t kernel_set_rows_iso<int64_t, block_isoquant4_64, 4, QK_ISO64>;
template [[host_name("kernel_set_rows_isoquant4_64_i32")]] kernel set_rows_iso_t kernel_set_rows_iso<int32_t, block_isoquant4_64, 4, QK_ISO64>;

// CPY between F32 and a type, and from a type to F32/F16 (the unfused path's dequantisation, K-shift's casts): source
// and destination of one shape, rows of whole blocks, any row strides; threadgroup (i01, i02, i03), one simdgroup per
// row. (Upstream's cpy kernels also reshape through the linear index; ours are refused for that in supports_op.)
template <typename block_q, short BITS, short QK>
kernel void kernel_cpy_f32_iso(
        constant ggml_metal_kargs_cpy & args,
        device const char * src0,
        device       char * dst,
        uint3   tgpig[[threadgroup_position_in_grid]],
        ushort  tiisg[[thread_index_in_simdgroup]]) {
    device const float   * src_row = (device const float *) (src0 + tgpig.x*args.nb01 + tgpig.y*args.nb02 + tgpig.z*args.nb03);
    device       block_q * dst_row = (device block_q *) (dst + tgpig.x*args.nb1 + tgpig.y*args.nb2 + tgpig.z*args.nb3);
    rq_iso_quant_row<block_q, BITS, QK>(src_row, dst_row, (int) args.nk0, tiisg);
}

template <typename block_q, short BITS, short QK, typename T>
kernel void kernel_cpy_iso_t(
        constant ggml_metal_kargs_cpy & args,
        device const char * src0,
        device       char * dst,
        threadgroup uchar * shmem [[threadgroup(0)]],
        uint3   tgpig[[threadgroup_position_in_grid]],
        ushort  tiisg[[thread_index_in_simdgroup]]) {
    device const uchar * src_row = (device const uchar *) (src0 + tgpig.x*args.nb01 + tgpig.y*args.nb02 + tgpig.z*args.nb03);
    device       T     * dst_row = (device T *) (dst + tgpig.x*args.nb1 + tgpig.y*args.nb2 + tgpig.z*args.nb3);
    rq_iso_dequant_row<block_q, BITS, QK, T>(src_row, dst_row, (int) args.nk0, shmem, tiisg);
}

typedef decltype(kernel_cpy_f32_iso<block_isoquant3_0, 3, QK_ISO>) cpy_f32_iso_t;
typedef decltype(kernel_cpy_iso_t<block_isoquant3_0, 3, QK_ISO, float>) cpy_iso_t_t;

template [[host_name("kernel_cpy_f32_isoquant3_0")]]  kernel cpy_f32_iso_t kernel_cpy_f32_iso<block_isoquant3_0,  3, QK_ISO>;
template [[host_name("kernel_cpy_f32_isoquant4_0")]]  kernel cpy_f32_iso_t kernel_cpy_f32_iso<block_isoquant4_0,  4, QK_ISO>;
template [[host_name("kernel_cpy_f32_isoquant3_64")]] kernel cpy_f32_iso_t kernel_cpy_f32_iso<block_isoquant3_64, 3, QK_ISO64>;
template [[host_name("kernel_cpy_f32_isoquant4_64")]] kernel cpy_f32_iso_t kernel_cpy_f32_iso<block_isoquant4_64, 4, QK_ISO64>;

template [[host_name("kernel_cpy_isoquant3_0_f32")]]  kernel cpy_iso_t_t kernel_cpy_iso_t<block_isoquant3_0,  3, QK_ISO,   float>;
template [[host_name("kernel_cpy_isoquant4_0_f32")]]  kernel cpy_iso_t_t kernel_cpy_iso_t<block_isoquant4_0,  4, QK_ISO,   float>;
template [[host_name("kernel_cpy_isoquant3_64_f32")]] kernel cpy_iso_t_t kernel_cpy_iso_t<block_isoquant3_64, 3, QK_ISO64, float>;
template [[host_name("kernel_cpy_isoquant4_64_f32")]] kernel cpy_iso_t_t kernel_cpy_iso_t<block_isoquant4_64, 4, QK_ISO64, float>;

typedef decltype(kernel_cpy_iso_t<block_isoquant3_0, 3, QK_ISO, half>) cpy_iso_h_t;

template [[host_name("kernel_cpy_isoquant3_0_f16")]]  kernel cpy_iso_h_t kernel_cpy_iso_t<block_isoquant3_0,  3, QK_ISO,   half>;
template [[host_name("kernel_cpy_isoquant4_0_f16")]]  kernel cpy_iso_h_t kernel_cpy_iso_t<block_isoquant4_0,  4, QK_ISO,   half>;
template [[host_name("kernel_cpy_isoquant3_64_f16")]] kernel cpy_iso_h_t kernel_cpy_iso_t<block_isoquant3_64, 3, QK_ISO64, half>;
template [[host_name("kernel_cpy_isoquant4_64_f16")]] kernel cpy_iso_h_t kernel_cpy_iso_t<block_isoquant4_64, 4, QK_ISO64, half>;
