"""Shared fixtures. The suite runs after `make setup` (the README test command does both)."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from rotaryquant import assets, paths
from rotaryquant.bindings import tools

# the tools and Llama(...) keep measured K statistics in LLAMA_CACHE/rq-k-stats: the suite's stay out of the user's
_cache = tempfile.mkdtemp(prefix="rq-tests-llama-cache-")
os.environ["LLAMA_CACHE"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    d = tools.bin_dir()
    if not (d / "llama-cli").exists():
        pytest.fail(f"no patched build in {d}: run `make setup` first")
    return d


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return assets.model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return assets.model_path("gemma3-270m")


@pytest.fixture(scope="session")
def smol_cal(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 with rq-calibrate's K statistics (512 tokens)."""
    from rotaryquant.converter import kcenter

    out = tmp_path_factory.mktemp("cal") / "smol-cal.gguf"
    kcenter.calibrate(smollm2, out, n_tokens=512, n_ctx=512, progress=False)
    return out


@pytest.fixture(scope="session")
def text_file() -> Path:
    return assets.text_path()


@pytest.fixture(scope="session")
def upstream_tree() -> Path:
    root = paths.src_root()
    if not (root / ".git").exists():
        pytest.fail(f"no upstream tree at {root}: run `make setup` first")
    return root


@pytest.fixture()
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def sane(text: str) -> bool:
    """Looks like language: enough words, mostly letters, not one word repeated."""
    words = text.split()
    if len(words) < 5:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text) / max(1, len(text))
    return letters > 0.7 and len(set(words)) / len(words) > 0.4


@pytest.fixture(scope="session")
def sane_text():
    return sane


def shift_out(llm, a: list[int], keep: int, nd: int) -> None:
    """Evaluate ``a`` in a llama_cpp.Llama, then drop tokens [keep, keep + nd) of sequence 0 and move the rest back
    (llama.cpp's K-shift), leaving the Llama's bookkeeping as if it had evaluated the retained tokens."""
    import llama_cpp

    llm.eval(a)
    mem = llama_cpp.llama_get_memory(llm.ctx)
    llama_cpp.llama_memory_seq_rm(mem, 0, keep, keep + nd)
    llama_cpp.llama_memory_seq_add(mem, 0, keep + nd, len(a), -nd)
    llm.n_tokens = len(a) - nd
    llm.input_ids[: llm.n_tokens] = a[:keep] + a[keep + nd:]


@pytest.fixture(scope="session")
def kv_shift():
    return shift_out


@pytest.fixture(scope="session")
def smollm2_f16(bin_dir, smollm2, tmp_path_factory) -> Path:
    """SmolLM2 requantised to F16: the baseline that quantisers start from (its weights are Q4_1-rounded)."""
    import subprocess

    out = tmp_path_factory.mktemp("f16") / "smollm2-f16.gguf"
    proc = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(smollm2), str(out), "F16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture()
def rpc_server(bin_dir):
    """A ggml-rpc-server on a free loopback port (a CPU backend that llama sees as a GPU-type device)."""
    from rotaryquant.eval import serve

    with serve.rpc_worker() as (endpoint, _):
        yield endpoint
