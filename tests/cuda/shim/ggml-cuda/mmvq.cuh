// Stands in for upstream's ggml-cuda/mmvq.cuh in the CUDA emulation: the batch limit of the MMVQ slot
#pragma once

#include "common.cuh"

#define MMVQ_MAX_BATCH_SIZE 8
