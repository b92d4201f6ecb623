"""rotaryquant.bindings: llama_cpp runs on our patched library; type ids, (de)quantisation, counters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rotaryquant import bindings, paths


def test_fresh_interpreter_loads_the_patched_library():
    # no environment variable: llama_cpp must find our build by itself
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    code = (
        "import llama_cpp, ctypes, pathlib;"
        "maps = pathlib.Path('/proc/self/maps').read_text();"
        "libs = sorted({l.split()[-1] for l in maps.splitlines() if 'libllama.so' in l or 'libggml-base.so' in l});"
        "print(llama_cpp.GGML_TYPE_ISOQUANT3_0, llama_cpp.GGML_TYPE_ITQ3_S, llama_cpp.GGML_TYPE_COUNT);"
        "base = [l for l in libs if 'libggml-base.so' in l][0];"
        "print(ctypes.CDLL(base).ggml_rq_version());"
        "print('\\n'.join(libs))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    # GGML_TYPE_COUNT as the patched ggml.h that built the library declares it (it grows with our types)
    ggml_h = (paths.llama_root() / "ggml" / "include" / "ggml.h").read_text()
    count = re.search(r"GGML_TYPE_COUNT\s*=\s*(\d+)", ggml_h).group(1)
    assert lines[0] == f"240 241 {count}"
    assert int(lines[1]) >= 2  # a stock libggml-base has no ggml_rq_version
    build = paths.build_dir().resolve()
    for lib in lines[2:]:
        assert Path(lib).resolve().is_relative_to(build), f"{lib} is not from our build in {build}"


def test_type_ids_agree_everywhere():
    import gguf
    import llama_cpp

    assert bindings.type_from_name("isoquant3_0") == llama_cpp.GGML_TYPE_ISOQUANT3_0 == 240
    assert gguf.GGMLQuantizationType.ISOQUANT3_0 == 240
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.ISOQUANT3_0] == (128, 50)
    assert bindings.row_size(bindings.GGMLType.ISOQUANT3_0, 256) == 100
    assert bindings.type_from_name("isoquant4_0") == llama_cpp.GGML_TYPE_ISOQUANT4_0 == 244
    assert gguf.GGMLQuantizationType.ISOQUANT4_0 == 244
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.ISOQUANT4_0] == (128, 66)
    assert bindings.row_size(bindings.GGMLType.ISOQUANT4_0, 256) == 132
    with pytest.raises(bindings.RQTypeError, match="unknown ggml type"):
        bindings.type_from_name("isoquant9_9")


def test_quantize_roundtrip_through_ggml():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    limit = {bindings.GGMLType.Q8_0: 0.01, bindings.GGMLType.ISOQUANT3_0: 0.25, bindings.GGMLType.ISOQUANT4_0: 0.12}
    for t, lim in limit.items():
        q = bindings.quantize(x, t)
        assert q.shape == (64, bindings.row_size(t, 256))
        y = bindings.dequantize(q, t, 256)
        rel = np.linalg.norm(y - x) / np.linalg.norm(x)
        assert rel < lim
    with pytest.raises(ValueError, match="block size"):
        bindings.quantize(x[:, :100], bindings.GGMLType.ISOQUANT3_0)


def test_counters_count_dequantised_rows():
    bindings.reset_counters()
    assert set(bindings.counters()) == set(bindings.COUNTERS)
    x = np.ones((3, 256), dtype=np.float32)
    q = bindings.quantize(x, bindings.GGMLType.ISOQUANT3_0)
    c = bindings.counters()
    assert c["iso_quant_rows"] == 6 and c["iso_dequant_rows"] == 0
    bindings.dequantize(q, bindings.GGMLType.ISOQUANT3_0, 256)
    assert bindings.counters()["iso_dequant_rows"] == 6
    bindings.reset_counters()
    assert bindings.counters()["iso_dequant_rows"] == 0


def test_iso_roundtrip_is_quantize_then_dequantize_and_counts_nothing():
    rng = np.random.default_rng(1)
    for name, n in (("isoquant3_0", 256), ("isoquant4_0", 128), ("isoquant3_64", 192), ("isoquant4_64", 64)):
        t = bindings.type_from_name(name)
        x = (rng.standard_normal((5, n)) * 3 + 1).astype(np.float32)
        want = bindings.dequantize(bindings.quantize(x, t), t, n)
        bindings.reset_counters()
        got = bindings.iso_roundtrip(x, t)
        assert np.array_equal(got, want), name
        assert bindings.counters()["iso_quant_rows"] == 0 and bindings.counters()["iso_dequant_rows"] == 0
    with pytest.raises(ValueError, match="not an IsoQuant type"):
        bindings.iso_roundtrip(x, bindings.GGMLType.Q8_0)


def test_switches_round_trip():
    assert bindings.iso_variant() == "v3"
    bindings.set_iso_variant("v2")
    try:
        assert bindings.iso_variant() == "v2"
    finally:
        bindings.set_iso_variant("v3")
    with pytest.raises(ValueError, match="unknown IsoQuant variant"):
        bindings.set_iso_variant("v9")
    # on unless GGML_RQ_CPU_AVX512=0 / GGML_RQ_CPU_SPLIT=0
    for get, put in ((bindings.cpu_avx512, bindings.set_cpu_avx512), (bindings.cpu_split, bindings.set_cpu_split)):
        assert get()
        put(False)
        try:
            assert not get()
        finally:
            put(True)


@pytest.mark.parametrize("switch,var", [("cpu_avx512", "GGML_RQ_CPU_AVX512"), ("cpu_split", "GGML_RQ_CPU_SPLIT")])
def test_cpu_switches_are_read_from_the_environment(switch, var):
    code = f"from rotaryquant import bindings; print(bindings.{switch}())"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, var: value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want



def test_context_settings_are_fields_of_the_context_params():
    import llama_cpp

    cp = llama_cpp.llama_context_default_params()
    # the recent window's default is -1: 16 positions where the cache can take it (llama-rq-types.h)
    assert (cp.iso_unfused, cp.k_center, cp.kv_deferred, cp.kv_window) == (False, llama_cpp.LLAMA_K_CENTER_AUTO, 0, -1)
    bindings.apply(cp, unfused=True, k_center="force", deferred=4096, window=0)
    assert (cp.iso_unfused, cp.k_center, cp.kv_deferred, cp.kv_window) == (True, llama_cpp.LLAMA_K_CENTER_FORCE, 4096, 0)
    bindings.apply(cp, deferred=True)
    assert (cp.iso_unfused, cp.k_center, cp.kv_deferred) == (False, llama_cpp.LLAMA_K_CENTER_AUTO, -1)
    assert cp.kv_window == -1
    with pytest.raises(ValueError, match="at least 2 cells"):
        bindings.apply(cp, deferred=1)
    with pytest.raises(ValueError, match="4096 positions"):
        bindings.apply(cp, window=5000)
    with pytest.raises(ValueError, match="k_center"):
        bindings.llama_kwargs(k_center="on")
    assert bindings.llama_kwargs(k_center="off", deferred=True) == {"iso_unfused": False, "k_center": False,
                                                                    "kv_deferred": True}
    # the library reads no environment: the tools map LLAMA_* variables onto these fields (common)
    assert not hasattr(bindings, "set_iso_unfused") and not hasattr(bindings, "set_kv_deferred")


def test_unhooked_archs_come_from_the_library():
    archs = bindings.unhooked_archs()
    assert "deepseek32" in archs and "llama" not in archs and len(set(archs)) == len(archs)
