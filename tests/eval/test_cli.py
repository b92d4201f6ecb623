"""rq-eval / rq-bench command lines: bad arguments are one clear line and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["rotaryquant.eval.cli", "ppl", "--kv", "q8_0,isoquant9"], "unknown ggml type 'isoquant9'"),
    (["rotaryquant.eval.cli", "niah", "--model", "/nonexistent.gguf"], "does not exist"),
    (["rotaryquant.eval.cli", "gate", "--kv", "f17"], "unknown ggml type 'f17'"),
    (["rotaryquant.eval.bench_cli", "--types", "f16,q9_9"], "unknown ggml type 'q9_9'"),
    (["rotaryquant.eval.bench_cli", "--model", "/nonexistent.gguf"], "does not exist"),
])
def test_bad_arguments(args, message):
    proc = _run(*args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_explains_every_command():
    proc = _run("rotaryquant.eval.cli", "--help")
    assert proc.returncode == 0
    for cmd in ("ppl", "ablation", "niah", "gate", "weights", "report"):
        assert cmd in proc.stdout
