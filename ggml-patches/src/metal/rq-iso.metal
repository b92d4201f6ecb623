// RotaryQuant IsoQuant on Metal: GET_ROWS of the four IsoQuant types, in ggml-metal's style (kernels/quantize.metal).
//
// Never compiled by Apple's compiler here: tests/metal runs this source as C++ under an emulation of threadgroups,
// simdgroups and barriers (tests/metal/shim), which checks logic, indexing and layout, not Apple's compiler or speed.

#include "rq-iso.h"

// GET_ROWS on the grid of upstream's kernel_get_rows_q: threadgroup (i10 + ne10*iw0, i11, i12), here one simdgroup
// per row (iw0 = 0) that walks the row's blocks; a block's bytes are staged in threadgroup memory by all lanes
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

    const int nb = args.ne00/QK;
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
                pdst[ib*QK + 4*tiisg + k] = x[k];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup); // the next block overwrites shmem
    }
}

typedef decltype(kernel_get_rows_iso<block_isoquant3_0, 3, QK_ISO>) get_rows_iso_t;

template [[host_name("kernel_get_rows_isoquant3_0")]]  kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant3_0,  3, QK_ISO>;
template [[host_name("kernel_get_rows_isoquant4_0")]]  kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant4_0,  4, QK_ISO>;
template [[host_name("kernel_get_rows_isoquant3_64")]] kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant3_64, 3, QK_ISO64>;
template [[host_name("kernel_get_rows_isoquant4_64")]] kernel get_rows_iso_t kernel_get_rows_iso<block_isoquant4_64, 4, QK_ISO64>;
