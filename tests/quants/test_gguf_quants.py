"""gguf-py knows our types: gguf.quants (de)quantises ITQ3_S and the IsoQuant types byte for byte as
the C library does (upstream's gguf-py/tests/test_quants.py check, for our types), GGUFReader reads
tensors of them back, and gguf-dump names them. The classes come from rotaryquant.quants.gguf_quants,
registered by the hook patch 0005 adds at the end of gguf/quants.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from rotaryquant import bindings
from rotaryquant.quants import isoquant, itq3

QT = GGMLQuantizationType
OURS = (QT.ITQ3_S, QT.ISOQUANT3_0, QT.ISOQUANT4_0, QT.ISOQUANT3_64, QT.ISOQUANT4_64)
ISO_SHAPES = {QT.ISOQUANT3_0: (3, 128), QT.ISOQUANT4_0: (4, 128), QT.ISOQUANT3_64: (3, 64), QT.ISOQUANT4_64: (4, 64)}


def _reference_dequantize(raw: np.ndarray, t: QT) -> np.ndarray:
    """rotaryquant's numpy references called directly: (rows, row_bytes) -> (rows, cols)."""
    block, size = GGML_QUANT_SIZES[t]
    b = raw.reshape(-1, size)
    if t == QT.ITQ3_S:
        y = itq3.dequantize_blocks(b)
    else:
        bits, qk = ISO_SHAPES[t]
        y = isoquant.dequantize_blocks(b, bits=bits, qk=qk)
    return y.reshape(*raw.shape[:-1], raw.shape[-1] // size * block)


def _rows(seed: int) -> np.ndarray:
    """(2, 48, 1024) float32 like upstream's test: Gaussian rows, one zero row; plus outlier columns,
    a wide range of row scales and constant rows (3-D: gguf.quants keeps the leading dimensions)."""
    rng = np.random.default_rng(seed)
    r = rng.standard_normal((2, 48, 1024)).astype(np.float32)
    r[0, 0] = 0
    r[0, 1:9, [3, 300, 777]] *= 30.0
    r[1, :16] *= (np.float32(10.0) ** rng.integers(-12, 12, size=(16, 1))).astype(np.float32)
    r[1, 16] = -2.5
    return r


def _c_quantize(x: np.ndarray, t: QT) -> np.ndarray:
    q = bindings.quantize(x.reshape(-1, x.shape[-1]), int(t))
    return q.reshape(*x.shape[:-1], q.shape[-1])


def _c_dequantize(q: np.ndarray, t: QT) -> np.ndarray:
    cols = gguf.quant_shape_from_byte_shape(q.shape, t)[-1]
    return bindings.dequantize(q.reshape(-1, q.shape[-1]), int(t), cols).reshape(*q.shape[:-1], cols)


@pytest.mark.parametrize("t", OURS, ids=lambda t: t.name)
def test_registered_with_ggml_sizes(t):
    cls = gguf.quants._type_traits[t]
    assert cls.__module__ == "rotaryquant.quants.gguf_quants"
    assert (cls.block_size, cls.type_size) == GGML_QUANT_SIZES[t]
    assert bindings.type_name(int(t)) == t.name.lower()
    assert bindings.row_size(int(t), 4 * cls.block_size) == 4 * cls.type_size  # ggml's traits row agrees


@pytest.mark.parametrize("t", OURS, ids=lambda t: t.name)
def test_quantize_matches_c(t):
    x = _rows(1)
    py = gguf.quants.quantize(x, t)
    c = _c_quantize(x, t)
    assert py.dtype == np.uint8 and py.shape == c.shape == gguf.quant_shape_to_byte_shape(x.shape, t)
    assert np.array_equal(py, c), f"{(py != c).any(axis=-1).sum()} of {c.shape[0] * c.shape[1]} rows differ"


@pytest.mark.parametrize("t", OURS, ids=lambda t: t.name)
def test_dequantize_matches_c(t):
    c = _c_quantize(_rows(2), t)
    py = gguf.quants.dequantize(c, t)
    want = _c_dequantize(c, t)
    assert py.dtype == np.float32 and py.shape == want.shape == _rows(2).shape
    assert np.array_equal(py.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("t", OURS, ids=lambda t: t.name)
def test_dequantize_random_f16_data_matches_c(t):
    """Upstream's second check: arbitrary block bytes (random fp16 words), not only what a quantiser wrote."""
    rng = np.random.default_rng(3)
    shape = gguf.quant_shape_to_byte_shape((4, 16, 512), t)
    raw = rng.random((*shape[:-1], shape[-1] // 2)).astype(np.float16).view(np.uint8)
    py = gguf.quants.dequantize(raw, t)
    want = _c_dequantize(raw, t)
    assert np.array_equal(py.view(np.uint32), want.view(np.uint32))


def _write_gguf(path: Path) -> dict[str, tuple[QT, np.ndarray, np.ndarray]]:
    """A small GGUF holding one tensor per type (2-D and 3-D): name -> (type, float input, written bytes)."""
    rng = np.random.default_rng(4)
    w = gguf.GGUFWriter(str(path), "llama")
    written = {}
    for i, (t, shape) in enumerate(zip(OURS + OURS, [(8, 512)] * 3 + [(2, 4, 256)] * 3)):
        x = rng.standard_normal(shape).astype(np.float32)
        q = gguf.quants.quantize(x, t)
        name = f"blk.{i}.weight"
        w.add_tensor(name, q, raw_dtype=t)
        written[name] = (t, x, q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def test_gguf_reader_round_trip(tmp_path):
    path = tmp_path / "ours.gguf"
    written = _write_gguf(path)
    r = gguf.GGUFReader(str(path))
    assert {t.name for t in r.tensors} == set(written)
    for t in r.tensors:
        qt, x, q = written[t.name]
        assert t.tensor_type == qt
        assert tuple(int(n) for n in reversed(t.shape)) == x.shape
        assert t.n_elements == x.size and t.n_bytes == q.nbytes
        data = np.asarray(t.data)
        assert np.array_equal(data.reshape(q.shape), q)
        y = gguf.quants.dequantize(data, qt)
        assert y.shape[-1] == x.shape[-1]
        ref = _reference_dequantize(q, qt)
        assert np.array_equal(y.reshape(x.shape).view(np.uint32), ref.view(np.uint32))
        assert np.array_equal(ref.view(np.uint32), _c_dequantize(q, qt).view(np.uint32))


def _gguf_dump(*args: str) -> str:
    exe = Path(sys.executable).with_name("gguf-dump")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gguf.scripts.gguf_dump"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, check=True, timeout=120).stdout


def test_gguf_dump_names_our_types(tmp_path):
    path = tmp_path / "ours.gguf"
    written = _write_gguf(path)
    rows = {ln.split("|")[-1].strip(): ln.split("|")[-2].strip() for ln in _gguf_dump(str(path)).splitlines()
            if ln.count("|") >= 3 and ln.split("|")[-1].strip() in written}
    assert rows == {name: qt.name for name, (qt, _, _) in written.items()}
    tensors = json.loads(_gguf_dump("--json", str(path)))["tensors"]
    assert {name: v["type"] for name, v in tensors.items()} == rows


def test_gguf_without_rotaryquant_is_upstream():
    """The hook only registers when rotaryquant imports: without it gguf-py behaves as upstream's."""
    code = ("import sys; sys.modules['rotaryquant'] = None\n"
            "import gguf, numpy as np\n"
            "assert gguf.GGMLQuantizationType.ITQ3_S not in gguf.quants._type_traits\n"
            "try:\n"
            "    gguf.quants.dequantize(np.zeros(100, np.uint8), gguf.GGMLQuantizationType.ITQ3_S)\n"
            "except NotImplementedError:\n"
            "    print('upstream')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "upstream", r.stderr
