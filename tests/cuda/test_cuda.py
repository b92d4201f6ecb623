"""The CUDA code without a GPU, beside its execution under emulation (test_emulation.py): an nvcc compile of our
units and of the upstream units patch 0008 touches (sm_90), so a CUDA compile error fails CI, and llama's
acceptance of a 64-wide IsoQuant cache on a GPU-type device (an RPC device stands in for the GPU)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from rotaryquant import paths


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")),
                    reason="no nvcc on this machine: the CUDA compile check needs the CUDA toolkit")
def test_cuda_units_compile_for_sm90(upstream_tree):
    proc = subprocess.run(["bash", str(paths.REPO / "scripts" / "cuda" / "ci-compile.sh"), "--tree", str(upstream_tree)],
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------------
# llama: a 64-wide IsoQuant cache on a GPU-type device is no longer refused at context creation (the guard of
# patch 0003 that did so, also with -ngl 0, is gone now that CUDA has kernels for the 64-wide types). No GPU
# here: ggml's RPC backend reports its devices as GPUs, so a loopback ggml-rpc-server (the CPU backend behind
# it) stands in for one. What this shows is llama's side only; the CUDA kernels run in scripts/cuda/gpu-check.sh.


def _smollm2_isoquant(bin_dir, model, extra, window=("--kv-window", "0")):
    # no recent window by default here: a cache on a GPU-type device has none (its kernels do not read it yet), and
    # the runs are compared with a host cache's
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", "The old lighthouse keeper", "-n", "16",
           "--temp", "0", "-no-cnv", "-t", "2", "-c", "256", "--no-warmup", "--no-display-prompt", "-lv", "4",
           "-fa", "on", "-ctk", "isoquant3_0", "-ctv", "isoquant3_0", *window, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("ngl", ["99", "0"])
def test_64_wide_isoquant_cache_on_a_gpu_type_device_is_accepted(bin_dir, smollm2, rpc_server, ngl):
    local = _smollm2_isoquant(bin_dir, smollm2, [])
    assert local.returncode == 0, local.stderr[-3000:]
    remote = _smollm2_isoquant(bin_dir, smollm2, ["--rpc", rpc_server, "-ngl", ngl])
    assert remote.returncode == 0, remote.stderr[-3000:]
    log = remote.stderr
    assert "CPU kernels only" not in log
    assert "using isoquant3_64" in log                # SmolLM2's head size 64: the 64-wide sibling
    assert "using device RPC0" in log, log[-3000:]     # the GPU-type device is in the model either way
    on_device = re.search(r"RPC\d+\[[^\]]+\] KV buffer size", log) is not None
    assert on_device == (ngl == "99"), log[-3000:]     # -ngl 99: the isoquant3_64 cache lives on it; -ngl 0: not
    assert remote.stdout == local.stdout              # the same kernels (the CPU's) behind the RPC device
    if ngl == "99":
        # the default window is off, and says so at INFO, for a cache on the device: the same text as --kv-window 0
        dflt = _smollm2_isoquant(bin_dir, smollm2, ["--rpc", rpc_server, "-ngl", ngl], window=())
        assert dflt.returncode == 0, dflt.stderr[-3000:]
        assert "recent window = off (the KV cache is on a GPU device" in dflt.stderr, dflt.stderr[-3000:]
        assert dflt.stdout == remote.stdout
