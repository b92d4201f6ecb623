// RotaryQuant on ggml-metal: which ops of our types the device takes, and their encoding (rq-metal.cpp). Called from
// ggml-metal-device.m (supports_op) and ggml-metal-ops.cpp (encode) by patch 0013; the kernels are kernels/rq.metal,
// made from this folder's .metal sources by rq-metal.cmake.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-metal-device.h"

#ifdef __cplusplus
extern "C" {
#endif

// 1: the device runs op, 0: it does not (the scheduler keeps it on the CPU), -1: not ours (upstream decides)
int  ggml_metal_rq_supports_op(const struct ggml_metal_device_props * props, const struct ggml_tensor * op);

// encodes op if it is one of ours (true), else leaves it to upstream (false)
bool ggml_metal_rq_encode(ggml_metal_library_t lib, ggml_metal_encoder_t enc, const struct ggml_tensor * op);

// fused IsoQuant flash-attention ops encoded on Metal so far (scripts/cuda/rq-counters.cpp reads it with dlsym)
GGML_BACKEND_API uint64_t ggml_rq_metal_fused_calls(void);

#ifdef __cplusplus
}
#endif
