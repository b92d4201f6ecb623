// IsoQuant on Vulkan: the block layout, tables and rotation of ggml-rq/isoquant.c, in the reference's
// operation order. Every float step that could be contracted into an FMA is `precise`, the norm is the same
// float64 tree, and float -> half rounds to nearest even in integer arithmetic (OpFConvert's rounding is the
// driver's choice), so quantised blocks and dequantised values match the CPU bit for bit.
//
// Compile-time: BITS (3 or 4), QK (128 or 64).

#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require

#include "isoquant-tables.glsl"    // generated from ../isoquant-tables.h by rq-vulkan.cmake
#include "rq-half.glsl"

#define ISO_NQ16 (QK*BITS/16)     // 16-bit words of packed indices per block
#define ISO_NLEV (1 << BITS)

// d is the fp16 bit pattern: read with unpackHalf2x16 (exact), written by rq_half_rte
struct block_iso {
    uint16_t d;
    uint16_t qs[ISO_NQ16];
};

// the codebook and decision bounds of this BITS / QK
#if QK == 128 && BITS == 3
#define ISO_CODEBOOK iq3_codebook
#define ISO_BOUNDS   iq3_bounds
#elif QK == 128
#define ISO_CODEBOOK iq4_codebook
#define ISO_BOUNDS   iq4_bounds
#elif BITS == 3
#define ISO_CODEBOOK iq3_64_codebook
#define ISO_BOUNDS   iq3_64_bounds
#else
#define ISO_CODEBOOK iq4_64_codebook
#define ISO_BOUNDS   iq4_64_bounds
#endif

const float ISO_WHT_SCALE = QK == 128 ? iq3_wht_scale : iq64_wht_scale;

// the BITS-bit index of value i of a block: group i/8 is the BITS-byte little-endian word at byte BITS*(i/8)
uint iso_index(const uint16_t qs[ISO_NQ16], uint i) {
    const uint o = BITS*(i >> 3);
    const uint w = (uint(qs[o >> 1]) | (uint(qs[(o >> 1) + 1]) << 16)) >> (8*(o & 1u));
    return (w >> (BITS*(i & 7u))) & (ISO_NLEV - 1);
}

// y = M u per group of 4 (M row-major), or M^T u with transpose
void iso_blocks(inout float v[QK], const bool transpose) {
    [[unroll]] for (uint g = 0; g < QK/4; ++g) {
        const float u0 = v[4*g+0], u1 = v[4*g+1], u2 = v[4*g+2], u3 = v[4*g+3];
        [[unroll]] for (uint r = 0; r < 4; ++r) {
            const float m0 = transpose ? iq3_so4[g][0*4 + r] : iq3_so4[g][r*4 + 0];
            const float m1 = transpose ? iq3_so4[g][1*4 + r] : iq3_so4[g][r*4 + 1];
            const float m2 = transpose ? iq3_so4[g][2*4 + r] : iq3_so4[g][r*4 + 2];
            const float m3 = transpose ? iq3_so4[g][3*4 + r] : iq3_so4[g][r*4 + 3];
            precise float a = m0*u0;
            precise float b = m1*u1;
            precise float c = m2*u2;
            precise float d = m3*u3;
            precise float y = ((a + b) + c) + d;
            v[4*g + r] = y;
        }
    }
}

// ggml_rq_wht: butterflies in the reference's order, then the scale
void iso_wht(inout float v[QK], const float scale) {
    for (uint h = 1; h < QK; h <<= 1) {
        for (uint i = 0; i < QK; i += 2*h) {
            for (uint j = i; j < i + h; ++j) {
                const float a = v[j];
                const float b = v[j + h];
                precise float s = a + b;
                precise float t = a - b;
                v[j]     = s;
                v[j + h] = t;
            }
        }
    }
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        precise float s = v[i] * scale;
        v[i] = s;
    }
}

// R = SO4 . WHT . diag(S) and its inverse (variant v3, the type as designed)
void iso_rotate(inout float v[QK], const float wht_scale) {
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        v[i] *= iq3_signs[i];
    }
    iso_wht(v, wht_scale);
    iso_blocks(v, false);
}

void iso_rotate_inv(inout float v[QK]) {
    iso_blocks(v, true);
    iso_wht(v, ISO_WHT_SCALE);
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        v[i] *= iq3_signs[i];
    }
}

// dequantize_row_isoquant*: x' = R^T (d * c[idx])
void iso_dequantize(const block_iso b, out float v[QK]) {
    const float d = unpackHalf2x16(uint(b.d)).x;
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        precise float y = d * ISO_CODEBOOK[iso_index(b.qs, i)];
        v[i] = y;
    }
    iso_rotate_inv(v);
}

#ifdef ISO_QUANTIZE
// sum of squares as isoquant.c's fixed float64 tree
double iso_tree_sumsq(const float x[QK]) {
    double a[QK];
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        precise double t = double(x[i]) * double(x[i]);
        a[i] = t;
    }
    for (uint s = QK/2; s > 0; s >>= 1) {
        for (uint i = 0; i < s; ++i) {
            precise double t = a[i] + a[i + s];
            a[i] = t;
        }
    }
    return a[0];
}

// quantize_row_isoquant*_ref for one block; wht_scale is ISO_WHT_SCALE, handed in as a value the compiler cannot fold
// (iso_quant.comp says why)
block_iso iso_quantize(const float x[QK], const float wht_scale) {
    const double sd = sqrt(iso_tree_sumsq(x));
    float v[QK];
    [[unroll]] for (uint i = 0; i < QK; ++i) {
        v[i] = sd > 0.0lf ? float(double(x[i]) / sd) : 0.0;
    }
    iso_rotate(v, wht_scale);

    block_iso b;
    uint q[ISO_NQ16];
    [[unroll]] for (uint i = 0; i < ISO_NQ16; ++i) {
        q[i] = 0;
    }
    float c[QK];
    [[unroll]] for (uint g = 0; g < QK/8; ++g) {
        uint w = 0;
        [[unroll]] for (uint j = 0; j < 8; ++j) {
            uint idx = 0;    // #{k : y > bounds[k]} (strict; a NaN gives 0)
            [[unroll]] for (uint k = 0; k < ISO_NLEV - 1; ++k) {
                idx += v[8*g + j] > ISO_BOUNDS[k] ? 1u : 0u;
            }
            c[8*g + j] = ISO_CODEBOOK[idx];
            w |= idx << (BITS*j);
        }
        [[unroll]] for (uint k = 0; k < BITS; ++k) {
            const uint o = BITS*g + k;
            q[o >> 1] |= ((w >> (8*k)) & 0xffu) << (8*(o & 1u));
        }
    }
    [[unroll]] for (uint i = 0; i < ISO_NQ16; ++i) {
        b.qs[i] = uint16_t(q[i]);
    }
    // norm-preserving scale; the codebooks have no zero level, so ||c|| > 0
    const double dd = sd / sqrt(iso_tree_sumsq(c));
    b.d = uint16_t(rq_half_rte(float(dd < 65504.0lf ? dd : 65504.0lf)));
    return b;
}
#endif
