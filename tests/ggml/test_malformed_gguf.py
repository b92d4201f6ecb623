"""GGUF files carrying our type ids but broken: a clear load error, never a crash or a misread."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import gguf

# gguf_init_from_file from our libggml-base, in a child process (a crash must not take pytest down)
_LOAD = r"""
import ctypes, sys
from rotaryquant import bindings
lib = ctypes.CDLL(str(bindings.lib_dir() / "libggml-base.so"))
class P(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]
lib.gguf_init_from_file.restype = ctypes.c_void_p
lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, P]
ctx = ctypes.c_void_p()
g = lib.gguf_init_from_file(sys.argv[1].encode(), P(False, ctypes.pointer(ctx)))
print("LOADED" if g else "REFUSED")
"""


def _gguf_load(path):
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"crashed: {proc.returncode} {proc.stderr[-1000:]}"
    return proc.stdout.strip(), proc.stderr


def _write(path, data: np.ndarray, type_id: int):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_k.weight", data, raw_dtype=gguf.GGMLQuantizationType(type_id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("type_id, row_bytes", [(240, 50), (241, 100)])
def test_well_formed_file_loads(tmp_path, type_id, row_bytes):
    path = tmp_path / "ok.gguf"
    _write(path, np.zeros((4, row_bytes * 2), np.uint8), type_id)
    assert _gguf_load(path)[0] == "LOADED"


@pytest.mark.parametrize("type_id, row_bytes", [(240, 50), (241, 100)])
def test_truncated_tensor_data_is_refused(tmp_path, type_id, row_bytes):
    path = tmp_path / "trunc.gguf"
    _write(path, np.zeros((4, row_bytes * 2), np.uint8), type_id)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - row_bytes])  # cut the last block
    status, err = _gguf_load(path)
    assert status == "REFUSED"
    assert "failed to read tensor data" in err or "tensor data" in err, err


@pytest.mark.parametrize("type_id, block", [(240, 128), (241, 256)])
def test_row_not_divisible_by_the_block_is_refused(tmp_path, type_id, block):
    path = tmp_path / "shape.gguf"
    row_bytes = 50 if type_id == 240 else 100
    _write(path, np.zeros((2, row_bytes), np.uint8), type_id)  # 2 rows x one block
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_k.weight"
    dims = data.index(name) + len(name) + 4  # after the name: uint32 n_dims, then uint64 ne[0]
    assert int.from_bytes(data[dims:dims + 8], "little") == block
    data[dims:dims + 8] = (block - 8).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    status, err = _gguf_load(path)
    assert status == "REFUSED"
    assert "block size" in err, err


@pytest.fixture()
def smollm2_itq3(bin_dir, smollm2_f16, tmp_path):
    itq = tmp_path / "itq3.gguf"
    p = subprocess.run([str(bin_dir / "llama-quantize"), str(smollm2_f16), str(itq), "ITQ3_S"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return itq


@pytest.mark.slow
def test_truncated_real_model_is_a_load_error(bin_dir, smollm2_itq3, tmp_path):
    data = smollm2_itq3.read_bytes()
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(data[: len(data) - 100_000])
    proc = subprocess.run([str(bin_dir / "llama-completion"), "-m", str(bad), "-p", "x", "-n", "1", "-no-cnv",
                           "--no-warmup"], capture_output=True, text=True, timeout=120)
    assert proc.returncode > 0, f"signal {-proc.returncode}" if proc.returncode < 0 else "loaded a truncated file"
    assert "failed to load model" in proc.stderr.lower() or "error" in proc.stderr.lower()


@pytest.mark.slow
def test_nan_scale_is_caught_by_check_tensors(bin_dir, smollm2_itq3):
    itq = smollm2_itq3
    r = gguf.GGUFReader(str(itq))
    t = next(t for t in r.tensors if t.tensor_type == gguf.GGMLQuantizationType.ITQ3_S)
    data = bytearray(itq.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.float16(np.nan).tobytes()  # first block's step d
    itq.write_bytes(bytes(data))
    proc = subprocess.run([str(bin_dir / "llama-completion"), "-m", str(itq), "-p", "x", "-n", "1", "-no-cnv",
                           "--no-warmup", "--check-tensors"], capture_output=True, text=True, timeout=300)
    assert proc.returncode > 0
    assert "invalid" in proc.stderr.lower() or "nan" in proc.stderr.lower(), proc.stderr[-2000:]
