"""llama.cpp's RPC backend with our types: layers and their isoquant3_0 KV cache live on a loopback
ggml-rpc-server (the same patched build); greedy output must equal the local run."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.slow


def _complete(bin_dir, model, extra, cache="isoquant3_0"):
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", "The old lighthouse keeper", "-n", "24",
           "--temp", "0", "-no-cnv", "-t", "2", "-c", "512", "--no-warmup", "--no-display-prompt",
           "-fa", "on", "-ctk", cache, "-ctv", cache, "--kv-window", "0", *extra]  # a cache on the device has none
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def test_isoquant_kv_and_itq3_weights_over_rpc(bin_dir, gemma3, tmp_path, rpc_server):
    # an ITQ3_S model: Gemma3's 2048-wide ffn_down rows take ITQ3_S (640-wide rows fall back)
    f16 = tmp_path / "g-f16.gguf"
    itq = tmp_path / "g-itq3.gguf"
    for args in (["--allow-requantize", gemma3, f16, "F16"], ["--tensor-type", "ffn_down=itq3_s", f16, itq, "Q8_0"]):
        p = subprocess.run([str(bin_dir / "llama-quantize"), *map(str, args)], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
    local, _ = _complete(bin_dir, itq, [])
    remote, log = _complete(bin_dir, itq, ["--rpc", rpc_server, "-ngl", "99", "-lv", "4"])
    # the layers really went to the RPC device
    assert "RPC" in log and ("offloaded" in log or "RPC0" in log), log[-3000:]
    assert remote == local
