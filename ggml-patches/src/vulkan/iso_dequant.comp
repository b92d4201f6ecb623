#version 450

// Dequantise IsoQuant blocks: GET_ROWS (-DGET_ROWS) and CPY ISO -> F32/F16, one invocation per block, on the
// grids of upstream's get_rows_quant.comp / copy_from_quant.comp. D_F16: write fp16 bits (rounded to nearest
// even, as the CPU's cast).

#include "rq-iso.glsl"

#define A_TYPE block_iso
#if defined(D_F16)
#define D_TYPE uint16_t
#else
#define D_TYPE float
#endif

#if defined(GET_ROWS)
#define B_TYPE uint
#include "generic_binary_head.glsl"
layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;
#else
#include "generic_unary_head.glsl"
layout(local_size_x = 1, local_size_y = 1, local_size_z = 1) in;
#endif

void store(const uint o, const float v[QK]) {
    [[unroll]] for (uint i = 0; i < QK; ++i) {
#if defined(D_F16)
        data_d[o + i] = uint16_t(rq_half_rte(v[i]));
#else
        data_d[o + i] = v[i];
#endif
    }
}

void main() {
    float v[QK];
#if defined(GET_ROWS)
    const uint ib = gl_GlobalInvocationID.x;    // block of the row
    if (ib*QK >= p.ne00) {
        return;
    }
    uint gid_z = gl_GlobalInvocationID.z;
    while (gid_z < p.ne11 * p.ne12) {
        uint gid_y = gl_GlobalInvocationID.y;
        while (gid_y < p.ne10) {
            const uint i10 = gid_y;
            const uint i11 = gid_z / p.ne12;
            const uint i12 = gid_z % p.ne12;
            const uint i01 = data_b[get_boffset() + i10*p.nb10 + i11*p.nb11 + i12*p.nb12];
            iso_dequantize(data_a[get_aoffset() + i01*p.nb01 + i11*p.nb02 + i12*p.nb03 + ib], v);
            store(get_doffset() + i10*p.nb21 + i11*p.nb22 + i12*p.nb23 + ib*QK, v);
            gid_y += gl_WorkGroupSize.y * gl_NumWorkGroups.y;
        }
        gid_z += gl_WorkGroupSize.z * gl_NumWorkGroups.z;
    }
#else
    const uint idx = gl_WorkGroupID.z * 262144 + gl_WorkGroupID.y * 512 + gl_WorkGroupID.x * QK;
    if (idx >= p.ne) {
        return;
    }
    iso_dequantize(data_a[src0_idx_quant(idx, QK) + get_aoffset()], v);
    store(get_doffset() + dst_idx(idx), v);
#endif
}
