"""The linter CI runs: ruff with the rules in pyproject.toml ([tool.ruff.lint]) over every Python file, and the
project's size rule: no Python file over 600 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True)
    assert "No module named ruff" not in proc.stderr, "ruff is a test dependency: re-run make setup"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


MAX_PY_LINES = 600


def test_no_python_file_over_600_lines():
    """The project rule: no Python file over 600 lines (split it by subject). Tracked files (git ls-files)."""
    proc = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    long = {}
    for name in filter(None, proc.stdout.split("\0")):
        path = REPO / name
        if path.is_file():
            n = len(path.read_bytes().splitlines())
            if n > MAX_PY_LINES:
                long[name] = n
    assert not long, f"Python files over {MAX_PY_LINES} lines (split them): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long.items()))
