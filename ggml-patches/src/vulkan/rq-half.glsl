// float -> fp16 bits for our shaders (rq-iso.glsl, itq3_dequant.comp)
#ifndef RQ_HALF_GLSL
#define RQ_HALF_GLSL

// float -> fp16 bits, round to nearest even (as F16C / GGML_FP32_TO_FP16 on the CPU)
uint rq_half_rte(float f) {
    uint x = floatBitsToUint(f);
    const uint sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) {
        return sign | 0x7e00u;                                   // NaN
    }
    if (x >= 0x47800000u) {
        return sign | 0x7c00u;                                   // >= 65536: inf
    }
    if (x < 0x38800000u) {
        // below 2^-14: a subnormal half, in units of 2^-24 (the scaling is exact)
        return sign | uint(roundEven(uintBitsToFloat(x) * 16777216.0));
    }
    const uint m   = x - 0x38000000u;                           // rebias 127 -> 15
    uint       r   = m >> 13;
    const uint rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u) != 0u)) {
        r += 1u;                                                 // a carry into the exponent is right, up to inf
    }
    return sign | r;
}

#endif
