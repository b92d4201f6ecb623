"""ISOQUANT3_0/4_0: the C quantiser in the patched ggml and the numpy reference agree byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant import bindings
from rotaryquant.quants import isoquant as iq

ISO = bindings.GGMLType.ISOQUANT3_0
ISO4 = bindings.GGMLType.ISOQUANT4_0
TYPES = {3: ISO, 4: ISO4}


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    g = rng.standard_normal((512, 128)).astype(np.float32)
    keys = g.copy()
    keys[:, [3, 17, 64, 99]] *= 15.0  # outlier channels, as real keys have
    keys += 0.7
    mixed = g * np.float32(10.0) ** rng.integers(-20, 20, size=(512, 1)).astype(np.float32)
    return {
        "gaussian": g,
        "keys": keys,
        "zero": np.zeros((4, 128), np.float32),
        "tiny": (g[:16] * np.float32(1e-30)).astype(np.float32),
        "denormal": np.full((4, 128), 1e-42, np.float32),
        "huge": (g[:16] * np.float32(1e30)).astype(np.float32),
        "mixed_scale": mixed.astype(np.float32),
        "one_hot": np.eye(128, dtype=np.float32)[:32] * 3.0,
        "constant": np.full((4, 128), -2.5, np.float32),
    }


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("name", list(_inputs()))
def test_c_matches_numpy_bytes(name, bits):
    x = _inputs()[name]
    t = TYPES[bits]
    c = bindings.quantize(x.reshape(-1, 256) if x.shape[0] % 2 == 0 else x, t).reshape(-1, iq.block_bytes(bits))
    py = iq.quantize_blocks(x, bits=bits)
    assert np.array_equal(c, py), f"{(c != py).any(axis=1).sum()} of {len(py)} blocks differ"
    # and the dequantisers agree bit for bit too
    dc = bindings.dequantize(c.reshape(x.shape[0], -1), t, 128)
    dp = iq.dequantize_blocks(py, bits=bits)
    assert np.array_equal(dc.view(np.uint32), dp.view(np.uint32))
    assert np.isfinite(dp).all()


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("variant", ["v2", "v1", "none"])
def test_ablation_variants_match_numpy(variant, bits):
    x = _inputs()["keys"][:64]
    bindings.set_iso_variant(variant)
    try:
        c = bindings.quantize(x, TYPES[bits]).reshape(-1, iq.block_bytes(bits))
        dc = bindings.dequantize(c, TYPES[bits], 128)
    finally:
        bindings.set_iso_variant("v3")
    assert np.array_equal(c, iq.quantize_blocks(x, variant=variant, bits=bits))
    assert np.array_equal(dc, iq.dequantize_blocks(c, variant=variant, bits=bits))


TYPES64 = {3: bindings.GGMLType.ISOQUANT3_64, 4: bindings.GGMLType.ISOQUANT4_64}


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("name", list(_inputs()))
def test_c_matches_numpy_bytes_qk64(name, bits):
    """ISOQUANT3_64/4_64: the 64-wide rotation and codebooks, C vs numpy, byte for byte (blocks of 64 values)."""
    x = _inputs()[name].reshape(-1, 64)
    t = TYPES64[bits]
    c = bindings.quantize(x, t).reshape(-1, iq.block_bytes(bits, 64))
    py = iq.quantize_blocks(x, bits=bits, qk=64)
    assert c.shape[1] == {3: 26, 4: 34}[bits]
    assert np.array_equal(c, py), f"{(c != py).any(axis=1).sum()} of {len(py)} blocks differ"
    dc = bindings.dequantize(c.reshape(x.shape[0], -1), t, 64)
    dp = iq.dequantize_blocks(py, bits=bits, qk=64)
    assert np.array_equal(dc.view(np.uint32), dp.view(np.uint32))
    assert np.isfinite(dp).all()


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("variant", ["v2", "v1", "none"])
def test_ablation_variants_match_numpy_qk64(variant, bits):
    x = _inputs()["keys"][:64].reshape(-1, 64)
    bindings.set_iso_variant(variant)
    try:
        c = bindings.quantize(x, TYPES64[bits]).reshape(-1, iq.block_bytes(bits, 64))
        dc = bindings.dequantize(c, TYPES64[bits], 64)
    finally:
        bindings.set_iso_variant("v3")
    assert np.array_equal(c, iq.quantize_blocks(x, variant=variant, bits=bits, qk=64))
    assert np.array_equal(dc, iq.dequantize_blocks(c, variant=variant, bits=bits, qk=64))
