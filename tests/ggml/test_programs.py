"""The C/C++ test programs built with the tree: ours (tests/c) and upstream's, restricted to our types."""

from __future__ import annotations

import subprocess

import pytest


def _run(cmd, timeout=900):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_fused_attention_matches_dequantised_twin(bin_dir):
    rc, out = _run([bin_dir / "test-rq-attn"])
    assert rc == 0, out[-4000:]


def test_itq3_matmul_matches_dequantised_twin(bin_dir):
    rc, out = _run([bin_dir / "test-rq-itq3"])
    assert rc == 0, out[-4000:]


def test_attention_benchmark_runs_and_refuses_bad_shapes(bin_dir):
    # a benchmark, not a speed check: every configuration at both thread counts gives a finite time
    rc, out = _run([bin_dir / "bench-rq-attn", "64", "4", "2", "1", "2"])
    assert rc == 0, out[-4000:]
    rows = [ln.split("|") for ln in out.splitlines() if ln.startswith("| ") and "ms" not in ln]
    assert len(rows) == 18 and {r[2].strip() for r in rows} == {"1", "2"}, out
    assert sum("sharp" in r[1] for r in rows) == 4, out  # the query x30 rows, both kernels, both thread counts
    assert all(0 < float(r[4]) < 1e4 for r in rows), out
    rc, out = _run([bin_dir / "bench-rq-attn", "64", "12", "5"])
    assert rc == 1 and "usage" in out


def test_fuzz_harness_bounded_run(bin_dir):
    # ASan + UBSan around our sources; random and adversarial blocks (NaN/Inf/max fp16 scales, zeros)
    rc, out = _run([bin_dir / "fuzz-rq", "-runs", "4000", "-seed", "20261129"])
    assert rc == 0, out[-4000:]
    assert "no crash, NaN policy held" in out


def test_upstream_quantize_fns(bin_dir):
    rc, out = _run([bin_dir / "test-quantize-fns", "-v"])
    assert rc == 0, out[-4000:]
    # our type was really exercised (not skipped)
    assert "isoquant3_0 absolute quantization error:    ok" in out
    assert "isoquant3_0 dot product error:              ok" in out
    assert "isoquant4_0 absolute quantization error:    ok" in out
    assert "isoquant4_0 dot product error:              ok" in out
    assert "isoquant3_64 absolute quantization error:    ok" in out
    assert "isoquant3_64 dot product error:              ok" in out
    assert "isoquant4_64 absolute quantization error:    ok" in out
    assert "isoquant4_64 dot product error:              ok" in out
    assert "itq3_s absolute quantization error:    ok" in out
    assert "itq3_s dot product error:              ok" in out


@pytest.mark.slow
@pytest.mark.parametrize("op", ["FLASH_ATTN_EXT", "GET_ROWS", "SET_ROWS", "CPY", "MUL_MAT", "MUL_MAT_ID"])
def test_backend_ops_cpu_rotaryquant_types(bin_dir, op):
    # -b CPU: the optimised CPU backend (fused paths) against the same backend in reference mode
    rc, out = _run([bin_dir / "test-backend-ops", "test", "-b", "CPU", "-o", op, "-p", "isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s"])
    assert rc == 0, out[-4000:]
    n_ok = out.count("OK")
    assert n_ok > 0 and "FAIL" not in out, out[-4000:]
