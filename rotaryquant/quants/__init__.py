"""Numpy references of our ggml types, bit-exact with the C library: ``isoquant`` (ISOQUANT3_0/4_0 KV cache),
``itq3`` (ITQ3_S weights), their tables, and ``gguf_quants`` (the same as gguf.quants classes)."""

import numpy as np


def as_blocks(x, dtype, qk: int, name: str = "x") -> np.ndarray:
    """x as a C-contiguous (n, qk) array of dtype: one row per block, as the C quantisers take them."""
    a = np.asarray(x, dtype=dtype)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2 or a.shape[1] != qk:
        raise ValueError(f"{name}: expected shape (n, {qk}), got {np.shape(x)}")
    return np.ascontiguousarray(a)
