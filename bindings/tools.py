"""Locate the patched llama.cpp programs (llama-cli, llama-server, llama-bench, ...)."""

from __future__ import annotations

import os
from pathlib import Path

from rotaryquant import paths
from rotaryquant.errors import MissingBuildError


def bin_dir() -> Path:
    """The build's bin folder (``RQ_BIN_DIR`` overrides, e.g. for a CUDA build folder)."""
    return Path(os.environ.get("RQ_BIN_DIR", paths.bin_dir("cpu")))


def binary(name: str) -> Path:
    """Path of one patched program; MissingBuildError if set-up has not built it."""
    p = bin_dir() / name
    if not p.exists():
        raise MissingBuildError(f"{name} is not built ({p} does not exist)")
    return p
