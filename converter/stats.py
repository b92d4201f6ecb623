"""The measured statistic behind promotions: excess kurtosis, of weights or of activations.

Weights: the sample excess kurtosis of all values of the tensor, ``m4 / m2^2 - 3`` with central
moments (0 for a Gaussian; the paper's shared expert 10.10, routed experts 0.41). Deviations in float32,
sums in float64, over chunks, so the peak extra memory is one chunk.

Activations: an importance matrix (llama-imatrix) stores, per input column j, ``s_j = E[x_j^2]``.
If each column were Gaussian with variance ``s_j``, the pooled activations would be a Gaussian scale
mixture whose excess kurtosis is ``3 * mean(s^2) / mean(s)^2 - 3``: 0 when every column has the same
energy, large when a few channels carry outliers (the case rotation-based quantisation cares about).
For an expert tensor (one importance vector per expert) the mean over experts is reported.
"""

from __future__ import annotations

import math

import numpy as np

_CHUNK = 1 << 22  # values per chunk (32 MiB of float64)


def excess_kurtosis(x: np.ndarray) -> float:
    """Sample excess kurtosis of every value of ``x`` (float64 accumulation, chunked). NaN if constant."""
    flat = np.asarray(x).reshape(-1)
    n = flat.size
    if n < 4:
        return float("nan")
    s1 = 0.0
    for i in range(0, n, _CHUNK):
        s1 += float(np.sum(flat[i:i + _CHUNK], dtype=np.float64))
    mu = s1 / n
    m2 = m4 = 0.0
    wide = flat.dtype.itemsize > 4 or not np.issubdtype(flat.dtype, np.floating)
    for i in range(0, n, _CHUNK):
        # float32 deviations, float64 sums: a relative error ~1e-7, twice as fast as float64 throughout
        d = flat[i:i + _CHUNK].astype(np.float64 if wide else np.float32) - (mu if wide else np.float32(mu))
        d2 = d * d
        m2 += float(np.sum(d2, dtype=np.float64))
        m4 += float(np.sum(d2 * d2, dtype=np.float64))
    m2 /= n
    m4 /= n
    if not m2 > 0 or not math.isfinite(m4):
        return float("nan")
    return m4 / (m2 * m2) - 3.0


def activation_kurtosis(imatrix: np.ndarray) -> float:
    """Excess kurtosis of activations implied by per-column mean squares (see module docstring)."""
    s = np.asarray(imatrix, dtype=np.float64)
    s = s.reshape(-1, s.shape[-1])
    vals = []
    for row in s:
        m1 = row.mean()
        if m1 > 0:
            vals.append(3.0 * float(np.mean(row * row)) / (m1 * m1) - 3.0)
    return float(np.mean(vals)) if vals else float("nan")
