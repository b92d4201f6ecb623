#version 450

// Fused flash attention on IsoQuant K and/or V (FLASH_ATTN_EXT), as ggml-rq/cpu's ggml_rq_fa_iso_rows: the
// query is rotated once per IsoQuant K block, keys are scored against the packed codes, V is accumulated in the
// rotated domain and rotated back once per output row. Nothing is dequantised to memory.
//
// One workgroup per (query row, head, stream); WG invocations split the keys of a tile, then the output
// dimensions. K_TYPE / V_TYPE (specialisation constants) are F16, Q8_0 or one of the four IsoQuant types.

#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require

#include "isoquant-tables.glsl"    // generated from ../isoquant-tables.h by rq-vulkan.cmake

#define WG 64
#define DMAX 256       // largest head size (ggml-rq/vulkan/rq-vulkan.cpp checks)
#define NEG_INF uintBitsToFloat(0xff800000u)

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

// type codes (rq-vulkan.cpp: rq_vk_fa_code)
#define T_F16   0
#define T_Q8_0  1
#define T_ISO3  2    // ISOQUANT3_0
#define T_ISO4  3    // ISOQUANT4_0
#define T_ISO3S 4    // ISOQUANT3_64
#define T_ISO4S 5    // ISOQUANT4_64

layout(constant_id = 0) const uint K_TYPE = T_F16;
layout(constant_id = 1) const uint V_TYPE = T_F16;

layout(push_constant) uniform parameter {
    uint DK; uint DV; uint KV; uint N; uint n_head;
    uint nbq1; uint nbq2; uint nbq3;    // floats
    uint nbk1; uint nbk2; uint nbk3;    // 16-bit words
    uint nbv1; uint nbv2; uint nbv3;
    uint rk; uint rv;                   // GQA ratios: dim 2 | dim 3 << 16
    uint nem23;                         // mask broadcast: ne2 | ne3 << 16
    uint nbm1; uint nbm2; uint nbm3;
    float scale; float max_bias; float softcap;
    uint flags;                         // 1: mask, 2: sinks
    uint offq; uint offk; uint offv; uint offm; uint offs; uint offd;   // misalignments, in elements
} p;

layout(binding = 0) readonly  buffer Q {float    data_q[];};
layout(binding = 1) readonly  buffer K {uint16_t data_k[];};
layout(binding = 2) readonly  buffer V {uint16_t data_v[];};
layout(binding = 3) readonly  buffer M {uint16_t data_m[];};
layout(binding = 4) readonly  buffer S {float    data_s[];};
layout(binding = 5) writeonly buffer D {float    data_d[];};

bool t_iso(uint t)  { return t >= T_ISO3; }
uint t_bits(uint t) { return t == T_ISO3 || t == T_ISO3S ? 3 : 4; }
uint t_qk(uint t)   { return t == T_ISO3 || t == T_ISO4 ? 128 : t == T_Q8_0 ? 32 : 64; }
// 16-bit words per block (F16: one value)
uint t_words(uint t) { return t == T_F16 ? 1 : t == T_Q8_0 ? 17 : 1 + t_qk(t)*t_bits(t)/16; }

float t_level(uint t, uint i) {
    switch (t) {
        case T_ISO3:  return iq3_codebook[i];
        case T_ISO4:  return iq4_codebook[i];
        case T_ISO3S: return iq3_64_codebook[i];
        default:      return iq4_64_codebook[i];
    }
}

float half_at(uint16_t h) { return unpackHalf2x16(uint(h)).x; }

// the (byte-packed) word of 8 IsoQuant indices of group g, qs at 16-bit word w0 of the K or V buffer
#define ISO_GROUP(buf, w0, bits, g) \
    ((uint(buf[(w0) + ((bits)*(g) >> 1)]) | (uint(buf[(w0) + ((bits)*(g) >> 1) + 1]) << 16)) >> (8*(((bits)*(g)) & 1u)))

// value i of a Q8_0 block at word w0
#define Q8_AT(buf, w0, i) \
    float(int(((uint(buf[(w0) + 1 + ((i) >> 1)]) >> (8*((i) & 1u))) & 0xffu) << 24) >> 24)

shared float sh_q[DMAX];     // the query row (rotated per K block when K is IsoQuant)
shared float sh_o[DMAX];     // the output row before normalisation
shared float sh_p[WG];       // scores, then weights, of the current tile
shared float sh_ms;          // rescale of the running sums for this tile
shared float sh_M;
shared float sh_S;

// R = SO4 . WHT . diag(S) on sh_q[b .. b+qk) and R^T on sh_o[b .. b+qk) (one invocation per block)
void rotate_q(const uint b, const uint qk) {
    for (uint i = 0; i < qk; ++i) {
        sh_q[b + i] *= iq3_signs[i];
    }
    for (uint h = 1; h < qk; h <<= 1) {
        for (uint i = 0; i < qk; i += 2*h) {
            for (uint j = i; j < i + h; ++j) {
                const float a = sh_q[b + j], c = sh_q[b + j + h];
                sh_q[b + j] = a + c; sh_q[b + j + h] = a - c;
            }
        }
    }
    const float sc = qk == 128 ? iq3_wht_scale : iq64_wht_scale;
    for (uint g = 0; g < qk/4; ++g) {
        const vec4 u = vec4(sh_q[b + 4*g], sh_q[b + 4*g + 1], sh_q[b + 4*g + 2], sh_q[b + 4*g + 3]) * sc;
        for (uint r = 0; r < 4; ++r) {
            sh_q[b + 4*g + r] = dot(vec4(iq3_so4[g][4*r], iq3_so4[g][4*r + 1], iq3_so4[g][4*r + 2], iq3_so4[g][4*r + 3]), u);
        }
    }
}

void unrotate_o(const uint b, const uint qk) {
    for (uint g = 0; g < qk/4; ++g) {
        const vec4 u = vec4(sh_o[b + 4*g], sh_o[b + 4*g + 1], sh_o[b + 4*g + 2], sh_o[b + 4*g + 3]);
        for (uint r = 0; r < 4; ++r) {
            sh_o[b + 4*g + r] = dot(vec4(iq3_so4[g][r], iq3_so4[g][4 + r], iq3_so4[g][8 + r], iq3_so4[g][12 + r]), u);
        }
    }
    for (uint h = 1; h < qk; h <<= 1) {
        for (uint i = 0; i < qk; i += 2*h) {
            for (uint j = i; j < i + h; ++j) {
                const float a = sh_o[b + j], c = sh_o[b + j + h];
                sh_o[b + j] = a + c; sh_o[b + j + h] = a - c;
            }
        }
    }
    const float sc = qk == 128 ? iq3_wht_scale : iq64_wht_scale;
    for (uint i = 0; i < qk; ++i) {
        sh_o[b + i] *= sc * iq3_signs[i];
    }
}

// q . k for key row at 16-bit word w
float score(const uint w) {
    float s = 0.0;
    if (t_iso(K_TYPE)) {
        const uint bits = t_bits(K_TYPE), qk = t_qk(K_TYPE), nw = t_words(K_TYPE);
        for (uint b = 0; b < p.DK/qk; ++b) {
            const uint w0 = w + b*nw;
            float sb = 0.0;
            for (uint g = 0; g < qk/8; ++g) {
                const uint word = ISO_GROUP(data_k, w0 + 1, bits, g);
                [[unroll]] for (uint j = 0; j < 8; ++j) {
                    sb += sh_q[b*qk + 8*g + j] * t_level(K_TYPE, (word >> (bits*j)) & ((1u << bits) - 1));
                }
            }
            s += half_at(data_k[w0]) * sb;
        }
    } else if (K_TYPE == T_Q8_0) {
        for (uint b = 0; b < p.DK/32; ++b) {
            const uint w0 = w + b*17;
            float sb = 0.0;
            for (uint i = 0; i < 32; ++i) {
                sb += sh_q[32*b + i] * Q8_AT(data_k, w0, i);
            }
            s += half_at(data_k[w0]) * sb;
        }
    } else {
        for (uint i = 0; i < p.DK; ++i) {
            s += sh_q[i] * half_at(data_k[w + i]);
        }
    }
    return s;
}

// value dimension d of the value row at 16-bit word w (rotated domain for IsoQuant V)
float value(const uint w, const uint d) {
    if (t_iso(V_TYPE)) {
        const uint bits = t_bits(V_TYPE), qk = t_qk(V_TYPE);
        const uint w0 = w + (d/qk)*t_words(V_TYPE);
        const uint i = d % qk;
        const uint word = ISO_GROUP(data_v, w0 + 1, bits, i >> 3);
        return half_at(data_v[w0]) * t_level(V_TYPE, (word >> (bits*(i & 7u))) & ((1u << bits) - 1));
    } else if (V_TYPE == T_Q8_0) {
        const uint w0 = w + (d/32)*17;
        return half_at(data_v[w0]) * Q8_AT(data_v, w0, d % 32);
    }
    return half_at(data_v[w + d]);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint iq1 = gl_WorkGroupID.x;
    const uint iq2 = gl_WorkGroupID.y;
    const uint iq3 = gl_WorkGroupID.z;

    const uint kbase = p.offk + (iq2/(p.rk & 0xffffu))*p.nbk2 + (iq3/(p.rk >> 16))*p.nbk3;
    const uint vbase = p.offv + (iq2/(p.rv & 0xffffu))*p.nbv2 + (iq3/(p.rv >> 16))*p.nbv3;
    const uint mbase = p.offm + iq1*p.nbm1 + (iq2 % (p.nem23 & 0xffffu))*p.nbm2 + (iq3 % (p.nem23 >> 16))*p.nbm3;
    const bool has_mask = (p.flags & 1u) != 0;

    float slope = 1.0;
    if (p.max_bias > 0.0) {
        const uint  nh2 = 1u << findMSB(p.n_head);
        const float m0  = exp2(-p.max_bias / float(nh2));
        const float m1  = exp2(-(p.max_bias / 2.0) / float(nh2));
        slope = iq2 < nh2 ? pow(m0, float(iq2 + 1)) : pow(m1, float(2*(iq2 - nh2) + 1));
    }
    float scale = p.scale;
    if (p.softcap != 0.0) {
        scale /= p.softcap;
    }

    const uint qbase = p.offq + iq1*p.nbq1 + iq2*p.nbq2 + iq3*p.nbq3;
    for (uint i = tid; i < p.DK; i += WG) {
        sh_q[i] = data_q[qbase + i];
    }
    for (uint i = tid; i < p.DV; i += WG) {
        sh_o[i] = 0.0;
    }
    if (tid == 0) {
        sh_M = NEG_INF;
        sh_S = 0.0;
    }
    barrier();
    if (t_iso(K_TYPE) && tid < p.DK/t_qk(K_TYPE)) {
        rotate_q(tid*t_qk(K_TYPE), t_qk(K_TYPE));
    }
    barrier();

    for (uint j0 = 0; j0 < p.KV; j0 += WG) {
        const uint j = j0 + tid;
        float s = NEG_INF;
        if (j < p.KV) {
            const float mv = has_mask ? slope*half_at(data_m[mbase + j]) : 0.0;
            if (mv != NEG_INF) {
                s = score(kbase + j*p.nbk1)*scale;
                if (p.softcap != 0.0) {
                    s = p.softcap*tanh(s);
                }
                s += mv;
            }
        }
        sh_p[tid] = s;
        barrier();
        if (tid == 0) {
            float mt = NEG_INF;
            for (uint t = 0; t < WG; ++t) {
                mt = max(mt, sh_p[t]);
            }
            const float Mold = sh_M;
            const float Mnew = max(Mold, mt);
            sh_ms = Mnew == NEG_INF ? 1.0 : exp(Mold - Mnew);
            sh_M  = Mnew;
        }
        barrier();
        const float M = sh_M;
        const float w = s == NEG_INF ? 0.0 : exp(s - M);
        barrier();
        sh_p[tid] = w;
        barrier();
        if (tid == 0) {
            float st = 0.0;
            for (uint t = 0; t < WG; ++t) {
                st += sh_p[t];
            }
            sh_S = sh_S*sh_ms + st;
        }
        const float ms = sh_ms;
        const uint  nt = min(WG, p.KV - j0);
        for (uint d = tid; d < p.DV; d += WG) {
            float o = sh_o[d]*ms;
            for (uint t = 0; t < nt; ++t) {
                const float pt = sh_p[t];
                if (pt != 0.0) {
                    o += pt*value(vbase + (j0 + t)*p.nbv1, d);
                }
            }
            sh_o[d] = o;
        }
        barrier();
    }

    if (t_iso(V_TYPE) && tid < p.DV/t_qk(V_TYPE)) {
        unrotate_o(tid*t_qk(V_TYPE), t_qk(V_TYPE));
    }
    if (tid == 0 && (p.flags & 2u) != 0) {
        const float s = data_s[p.offs + iq2];
        const float M = sh_M;
        float ms = 1.0, vs = 1.0;
        if (s > M) {
            ms = exp(M - s);
        } else {
            vs = exp(s - M);
        }
        sh_ms = ms;
        sh_S  = sh_S*ms + vs;
    } else if (tid == 0) {
        sh_ms = 1.0;
    }
    barrier();
    const float S_inv = sh_S == 0.0 ? 0.0 : 1.0/sh_S;
    const uint  dbase = p.offd + ((iq3*p.N + iq1)*p.n_head + iq2)*p.DV;
    for (uint d = tid; d < p.DV; d += WG) {
        data_d[dbase + d] = sh_o[d]*sh_ms*S_inv;
    }
}
