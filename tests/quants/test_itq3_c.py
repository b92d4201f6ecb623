"""ITQ3_S: the numpy quantiser (rotaryquant/quants/itq3.py) and ggml's C quantiser agree byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant import bindings
from rotaryquant.quants import itq3

ITQ = bindings.GGMLType.ITQ3_S


def _rows() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    g = rng.standard_normal((64, 1024)).astype(np.float32)
    heavy = rng.standard_t(3, size=(64, 1024)).astype(np.float32)
    heavy[:, [5, 300, 777]] *= 30.0
    return {
        "gaussian": g,
        "heavy": heavy,
        "zero": np.zeros((2, 512), np.float32),
        "constant": np.full((2, 512), 0.75, np.float32),
        "spike": np.eye(256, dtype=np.float32)[:8] * 5.0,
        "tiny": g[:4] * np.float32(1e-30),
        "denormal": np.full((2, 256), 3e-41, np.float32),
        "huge": g[:4] * np.float32(1e30),
        "mixed": g[:16] * (np.float32(10.0) ** rng.integers(-12, 12, size=(16, 1))).astype(np.float32),
    }


@pytest.mark.parametrize("name", list(_rows()))
def test_c_matches_numpy(name):
    w = _rows()[name]
    c = bindings.quantize(w, ITQ)
    py = itq3.quantize_rows(w)
    assert np.array_equal(c, py), f"{(c != py).sum()} bytes differ"
    dc = bindings.dequantize(c, ITQ, w.shape[1])
    dp = itq3.dequantize_rows(py)
    assert np.array_equal(dc.view(np.uint32), dp.view(np.uint32))


@pytest.mark.parametrize("name", ["gaussian", "heavy", "mixed"])
def test_c_matches_numpy_with_imatrix(name):
    w = _rows()[name]
    rng = np.random.default_rng(3)
    imatrix = np.exp(rng.normal(0.0, 1.5, size=w.shape[1])).astype(np.float32)
    c = bindings.quantize(w, ITQ, imatrix=imatrix)
    py = itq3.quantize_rows(w, imatrix=imatrix)
    assert np.array_equal(c, py), f"{(c != py).sum()} bytes differ"


def test_real_weights_match(smollm2):
    import gguf

    r = gguf.GGUFReader(str(smollm2))
    t = next(t for t in r.tensors if t.name == "blk.3.ffn_down.weight")  # 1536 columns: 6 blocks per row
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)[:96]
    assert w.shape[1] % 256 == 0
    assert np.array_equal(bindings.quantize(w, ITQ), itq3.quantize_rows(w))
