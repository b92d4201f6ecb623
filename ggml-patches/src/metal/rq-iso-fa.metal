// RotaryQuant's fused flash attention on packed IsoQuant K/V (FLASH_ATTN_EXT, one query row per threadgroup, the
// decode case ggml-metal's flash_attn_ext_vec serves): the query is rotated once (q' = R q), each key scores as
// d_k * <q', cb[idx]> straight from its packed bits (R is orthogonal, so <q', R k> = <q, k>), values are accumulated in
// the rotated domain, and the output row gets one inverse rotation. Nothing is dequantised to memory.
//
// Grid: threadgroup (iq1 query row, iq2 head, iq3); NSG simdgroups split the keys (key j to simdgroup j % NSG), each
// with its own online softmax (M, S, O); simdgroup 0 merges them through threadgroup memory. Arguments as upstream's
// kernel_flash_attn_ext_vec (ggml_metal_kargs_flash_attn_ext_vec; K and V of one shape). Not covered (the host side
// must route these elsewhere): attention sinks, ALiBi (max_bias), logit softcap, K/V of different IsoQuant widths.
//
// Never compiled by Apple's compiler here: tests/metal runs this source as C++ under an emulation of threadgroups,
// simdgroups and barriers, against a float64 attention over ggml's dequantised K/V.

#include "rq-iso.h"

template <typename block_k, short KBITS, typename block_v, short VBITS, short D, short QK, short NSG, bool HAS_MASK>
kernel void kernel_flash_attn_ext_iso(
        constant ggml_metal_kargs_flash_attn_ext_vec & args,
        device const char * q,
        device const char * k,
        device const char * v,
        device const char * mask,
        device       char * dst,
        threadgroup float * shmem [[threadgroup(0)]],
        uint3   tgpig[[threadgroup_position_in_grid]],
        ushort  tiisg[[thread_index_in_simdgroup]],
        ushort  sgitg[[simdgroup_index_in_threadgroup]]) {
    static_assert(D % QK == 0 && (QK == QK_ISO || QK == QK_ISO64), "head size must be a multiple of the block");
    constexpr short NB = D/QK;    // blocks per head
    constexpr short NL = QK/4;    // lanes that hold values (4 each, per block)

    const int iq1 = tgpig.x;
    const int iq2 = tgpig.y;
    const int iq3 = tgpig.z;

    const int ikv2 = iq2/(args.ne02/args.ne_12_2);
    const int ikv3 = iq3/(args.ne03/args.ne_12_3);

    const bool lane_on = tiisg < NL;
    const ushort lane  = lane_on ? tiisg : 0;  // idle lanes of a 64-wide block shadow lane 0 and write nothing

    // q' = R q, once
    device const float * pq = (device const float *) (q + iq1*args.nb01 + iq2*args.nb02 + iq3*args.nb03);
    float4 qr[NB];
    for (short b = 0; b < NB; ++b) {
        float4 x;
        for (short c = 0; c < 4; ++c) {
            x[c] = pq[b*QK + 4*lane + c];
        }
        qr[b] = rq_iso_rotate<QK>(x, lane);
    }

    device const half * pm = (device const half *) (mask + iq1*args.nb31 + (iq2%args.ne32)*args.nb32 + (iq3%args.ne33)*args.nb33);

    float  M = -INFINITY;
    float  S = 0.0f;
    float4 O[NB];
    for (short b = 0; b < NB; ++b) {
        O[b] = float4(0.0f);
    }

    for (int j = sgitg; j < args.ne11; j += NSG) {
        const float mv = HAS_MASK ? (float) pm[j] : 0.0f;
        if (mv == -INFINITY) {
            continue;   // uniform over the simdgroup
        }
        device const block_k * kb = (device const block_k *) (k + j*args.nb11 + ikv2*args.nb12 + ikv3*args.nb13);
        float part = 0.0f;
        for (short b = 0; b < NB; ++b) {
            const float4 kc = rq_iso_codes<KBITS, QK>(kb[b].qs, lane, (float) kb[b].d);
            part += lane_on ? dot(qr[b], kc) : 0.0f;
        }
        const float s = simd_sum(part)*args.scale + mv;

        const float Mn = max(M, s);
        const float ms = exp(M - Mn);
        const float vs = exp(s - Mn);
        M = Mn;
        S = S*ms + vs;

        device const block_v * vb = (device const block_v *) (v + j*args.nb21 + ikv2*args.nb22 + ikv3*args.nb23);
        for (short b = 0; b < NB; ++b) {
            O[b] = O[b]*ms + rq_iso_codes<VBITS, QK>(vb[b].qs, lane, (float) vb[b].d)*vs;
        }
    }

    // merge the simdgroups: [NSG][2 + D] floats (M, S, O in the rotated domain)
    threadgroup float * ss = shmem + sgitg*(2 + D);
    if (tiisg == 0) {
        ss[0] = M;
        ss[1] = S;
    }
    if (lane_on) {
        for (short b = 0; b < NB; ++b) {
            for (short c = 0; c < 4; ++c) {
                ss[2 + b*QK + 4*lane + c] = O[b][c];
            }
        }
    }
#if !defined(RQ_MTL_BREAK_BARRIER)
    threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
    if (sgitg != 0) {
        return;
    }
    float Mall = -INFINITY;
    for (short g = 0; g < NSG; ++g) {
        Mall = max(Mall, shmem[g*(2 + D)]);
    }
    float  Sall = 0.0f;
    float4 Oall[NB];
    for (short b = 0; b < NB; ++b) {
        Oall[b] = float4(0.0f);
    }
    for (short g = 0; g < NSG; ++g) {
        threadgroup const float * sg = shmem + g*(2 + D);
        const float w = sg[0] == -INFINITY ? 0.0f : exp(sg[0] - Mall);
        Sall += sg[1]*w;
        for (short b = 0; b < NB; ++b) {
            float4 o;
            for (short c = 0; c < 4; ++c) {
                o[c] = sg[2 + b*QK + 4*lane + c];
            }
            Oall[b] += o*w;
        }
    }
    const float inv = Sall == 0.0f ? 0.0f : 1.0f/Sall;   // every key masked: a zero row

    // one inverse rotation per output row
    device float * pd = (device float *) dst + ((int64_t) iq3*args.ne2*args.ne1 + iq2 + (int64_t) iq1*args.ne1)*D;
    for (short b = 0; b < NB; ++b) {
        const float4 x = rq_iso_rotate_inv<QK>(Oall[b]*inv, lane);
        if (lane_on) {
            for (short c = 0; c < 4; ++c) {
                pd[b*QK + 4*lane + c] = x[c];
            }
        }
    }
}

#define RQ_FA_ISO(name, bk, kb, bv, vb, d, qk) \
    template [[host_name(name)]] kernel fa_iso_t kernel_flash_attn_ext_iso<bk, kb, bv, vb, d, qk, 4, true>;

typedef decltype(kernel_flash_attn_ext_iso<block_isoquant3_0, 3, block_isoquant3_0, 3, 128, QK_ISO, 4, true>) fa_iso_t;

// names as rq-metal.cpp builds them: kernel_flash_attn_ext_iso_<K type>_<V type>_dk<head size>
RQ_FA_ISO("kernel_flash_attn_ext_iso_isoquant3_0_isoquant3_0_dk128",  block_isoquant3_0,  3, block_isoquant3_0,  3, 128, QK_ISO)
RQ_FA_ISO("kernel_flash_attn_ext_iso_isoquant4_0_isoquant3_0_dk128",  block_isoquant4_0,  4, block_isoquant3_0,  3, 128, QK_ISO)
RQ_FA_ISO("kernel_flash_attn_ext_iso_isoquant4_0_isoquant4_0_dk128",  block_isoquant4_0,  4, block_isoquant4_0,  4, 128, QK_ISO)
RQ_FA_ISO("kernel_flash_attn_ext_iso_isoquant3_0_isoquant3_0_dk256",  block_isoquant3_0,  3, block_isoquant3_0,  3, 256, QK_ISO)
RQ_FA_ISO("kernel_flash_attn_ext_iso_isoquant3_64_isoquant3_64_dk64", block_isoquant3_64, 3, block_isoquant3_64, 3,  64, QK_ISO64)
RQ_FA_ISO("kernel_flash_attn_ext_iso_isoquant4_64_isoquant4_64_dk64", block_isoquant4_64, 4, block_isoquant4_64, 4,  64, QK_ISO64)
