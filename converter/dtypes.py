"""Float formats at the converter's edges: the safetensors dtype table and bfloat16 <-> float32.

numpy only; the input readers (``hf``, ``torchshim``), the quantiser (``qtypes``) and the folders made
for the demo, benchmarks and tests (``hf_folders``) share these.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SAFETENSORS_DTYPES", "f32_to_bf16_bits", "bf16_bits_to_f32"]

# safetensors dtype name -> (numpy dtype holding its bits, bytes per element)
SAFETENSORS_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2),
                      "F64": (np.float64, 8), "I64": (np.int64, 8), "I32": (np.int32, 4),
                      "I16": (np.int16, 2), "I8": (np.int8, 1), "U8": (np.uint8, 1), "BOOL": (np.bool_, 1)}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (what torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def bf16_bits_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (any dtype viewed as uint16) -> float32, exact."""
    u16 = np.ascontiguousarray(raw).view(np.uint16)
    return (u16.astype(np.uint32) << 16).view(np.float32)
