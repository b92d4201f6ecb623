// what ggml-common.h includes for GGML_COMMON_DECL_CUDA: half and half2 (cuda_emu.h)
#pragma once
#include "cuda_emu.h"
