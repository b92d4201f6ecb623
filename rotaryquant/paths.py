"""Where things live: the checkout, its build folders and the user cache.

Stdlib only: the set-up tool imports this before any virtual environment exists.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_dir() -> Path:
    return Path(os.environ.get("RQ_BUILD_DIR", REPO / "build"))


def src_root() -> Path:
    """The unpacked llama-cpp-python sdist (a local git repo; first commit = pristine upstream)."""
    return build_dir() / "src" / "llama-cpp-python"


def llama_root() -> Path:
    return src_root() / "vendor" / "llama.cpp"


def cmake_build_dir(flavour: str = "cpu") -> Path:
    return build_dir() / flavour


def bin_dir(flavour: str = "cpu") -> Path:
    return cmake_build_dir(flavour) / "bin"


def cache_dir() -> Path:
    """Downloads, models and text: outside the clone so that a fresh clone reuses them."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rotaryquant"
    return Path(os.environ.get("RQ_CACHE", default))


def venv_dir() -> Path:
    return Path(os.environ.get("RQ_VENV", REPO / ".venv"))
