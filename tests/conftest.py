"""Shared fixtures. The suite runs after `make setup` (the README test command does both)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rotaryquant import assets, paths
from rotaryquant.bindings import tools


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

