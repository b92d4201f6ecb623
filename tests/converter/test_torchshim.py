"""The numpy stand-in for torch gives torch's results, op by op (compared with real torch when installed)."""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant.converter import torchshim as ts

OPS = [
    ("view shape", lambda t, x: x.view(6, 4)),
    ("view -1", lambda t, x: x.view(-1, 2)),
    ("reshape", lambda t, x: x.reshape(4, 6)),
    ("reshape tuple", lambda t, x: x.reshape((2, 12))),
    ("transpose 2 dims", lambda t, x: x.transpose(0, 2)),
    ("transpose -1 -2", lambda t, x: x.transpose(-1, -2)),
    ("swapaxes", lambda t, x: x.swapaxes(1, 2)),
    ("permute", lambda t, x: x.permute(2, 0, 1)),
    ("T of 2d", lambda t, x: x[0].T),
    ("unsqueeze", lambda t, x: x.unsqueeze(1)),
    ("squeeze non-1 dim", lambda t, x: x.squeeze(0)),
    ("squeeze 1 dim", lambda t, x: x[:, :1].squeeze(1)),
    ("flatten", lambda t, x: x.flatten()),
    ("flatten 1", lambda t, x: x.flatten(1)),
    ("repeat (tile)", lambda t, x: x.repeat(1, 2, 1)),
    ("repeat_interleave", lambda t, x: x.repeat_interleave(2, dim=1)),
    ("expand", lambda t, x: x[:, :1].expand(2, 5, 4)),
    ("split size", lambda t, x: t.cat(x.split(3, dim=2), dim=2)),
    ("split sizes", lambda t, x: x.split([1, 2], dim=1)[1]),
    ("chunk", lambda t, x: x.chunk(2, dim=2)[1]),
    ("stack", lambda t, x: t.stack([x, x + 1], dim=1)),
    ("cat", lambda t, x: t.cat([x, x * 2], dim=-1)),
    ("slice + contiguous", lambda t, x: x[..., 1:3].contiguous()),
    ("sum dim keepdim", lambda t, x: x.sum(dim=1, keepdim=True)),
    ("mean dim", lambda t, x: x.mean(dim=-1)),
    ("max dim values", lambda t, x: x.max(dim=1).values),
    ("max dim indices", lambda t, x: x.max(dim=1).indices),
    ("float", lambda t, x: x.to(t.int32).float()),
    ("to float16", lambda t, x: x.to(t.float16)),
    ("exp", lambda t, x: t.exp(x / 10)),
    ("arange", lambda t, x: t.arange(0, 10, 2, dtype=t.float32)),
    ("arange int", lambda t, x: t.arange(5)),
    ("tensor", lambda t, x: t.tensor([1.5, 2.0], dtype=t.float32)),
    ("zeros", lambda t, x: t.zeros((2, 3), dtype=t.float32)),
    ("llama permute", lambda t, x: (x.reshape(4, 6).reshape(2, 2, 1, 6).swapaxes(1, 2).reshape(4, 6))),
    ("add scalar", lambda t, x: 1.0 + x),
    ("size", lambda t, x: t.tensor(list(x.size()) + [x.size(1), x.numel(), x.dim()])),
]


INEXACT = {"exp"}


def _x(mod):
    return mod.arange(24, dtype=mod.float32).reshape(2, 3, 4)


@pytest.mark.parametrize("name,op", OPS, ids=[o[0] for o in OPS])
def test_op_matches_torch(name, op):
    got = op(ts, _x(ts))
    assert isinstance(got, ts.Tensor)
    torch = pytest.importorskip("torch")
    want = op(torch, _x(torch))
    assert tuple(got.shape) == tuple(want.shape)
    assert np.asarray(got).dtype == want.numpy().dtype
    if name in INEXACT:   # libm differences of one ulp
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    else:
        assert np.array_equal(np.asarray(got), want.numpy())


def test_bf16_bytes_widen_exactly():
    bits = np.array([0x3F80, 0xC000, 0x0001, 0x7F80, 0xFF80], dtype=np.uint16)
    got = ts.from_numpy(bits.view(np.uint8)).view(ts.bfloat16)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32) >> 16, bits.astype(np.uint32))
    torch = pytest.importorskip("torch")
    want = torch.from_numpy(bits.view(np.uint8).copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(np.asarray(got), want)


def test_numpy_functions_still_work_on_shim_tensors():
    x = _x(ts)
    assert np.repeat(x, 2, axis=0).shape == (4, 3, 4)        # numpy's own repeat semantics
    assert np.tile(x, 2).shape == (2, 3, 8)
    assert np.asarray(x).sum() == 276
    assert x.numpy().__class__ is np.ndarray


def test_unsupported_says_so():
    with pytest.raises(ts.ShimUnsupported, match="tensor-backend torch"):
        ts.some_new_torch_function  # noqa: B018
    with pytest.raises(AttributeError, match="tensor-backend torch"):
        _x(ts).bitwise_frobnicate()
    assert not hasattr(_x(ts), "frobnicate")
    with pytest.raises(ts.ShimUnsupported):
        ts.from_numpy(np.zeros(4, np.uint8)).view(ts.float8_e4m3fn)
    with pytest.raises(ts.ShimUnsupported, match="safetensors"):
        ts.load("pytorch_model.bin")


def test_installed_is_temporary():
    import sys

    before = sys.modules.get("torch")
    with ts.installed() as mod:
        import torch as t  # noqa: F401  (the stand-in)

        assert sys.modules["torch"] is mod
    assert sys.modules.get("torch") is before
