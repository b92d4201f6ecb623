"""ITQ3_S reconstruction error against the information-theoretic reference, and next to ggml's 3-bit types.

The issue asked for an RMSE below IQ3_S's. Measured, that is out of reach for any scalar 3-bit code: after
the rotation the weights are near-Gaussian, where the 8-level Lloyd-Max quantiser has a relative RMSE of
0.186 at best; IQ3_S (3.44 bpw) reaches 0.167 with a lattice vector codebook and per-32 scales. What ITQ3_S
must do is sit at the scalar bound on Gaussian *and* on real, outlier-heavy rows (where IQ3_S's grid falls
far behind), at 3.125 bpw. Its perplexity against IQ3_S is measured by `rq-eval weights`.
"""

from __future__ import annotations

import numpy as np

import gguf
from rotaryquant import bindings

LLOYD_MAX_3BIT_GAUSS = float(np.sqrt(0.03454))  # relative RMSE of the optimal 8-level scalar quantiser, N(0,1)


def _rel(x, t):
    y = bindings.dequantize(bindings.quantize(x, t), t, x.shape[1])
    return float(np.linalg.norm(y - x) / np.linalg.norm(x))


def test_at_the_scalar_bound_on_gaussian_rows():
    x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    e = _rel(x, bindings.GGMLType.ITQ3_S)
    assert e < 1.02 * LLOYD_MAX_3BIT_GAUSS, e
    # the rotation buys nothing on Gaussian data; the bits do: 3.125 vs 3.44 bpw and a vector codebook
    assert e < 1.15 * _rel(x, bindings.GGMLType.IQ3_S)


def test_at_the_scalar_bound_on_real_and_heavy_tailed_rows(smollm2):
    r = gguf.GGUFReader(str(smollm2))
    t = next(t for t in r.tensors if t.name == "blk.10.ffn_down.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)[:256]
    assert _rel(w, bindings.GGMLType.ITQ3_S) < 1.02 * LLOYD_MAX_3BIT_GAUSS
    # heavy tails with outlier columns (measured: ITQ3_S 0.146, IQ3_S 0.342, Q3_K 0.128): the rotation
    # spreads the outliers, so ITQ3_S stays at the bound where IQ3_S's grid does not; Q3_K's per-16
    # scales isolate outlier columns better still, at 3.44 bpw
    h = np.random.default_rng(1).standard_t(3, size=(128, 1024)).astype(np.float32)
    h[:, [5, 300, 777]] *= 30.0
    e_itq, e_iq3 = _rel(h, bindings.GGMLType.ITQ3_S), _rel(h, bindings.GGMLType.IQ3_S)
    assert e_itq < 1.02 * LLOYD_MAX_3BIT_GAUSS and e_itq < 0.6 * e_iq3, (e_itq, e_iq3)
