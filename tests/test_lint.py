"""The linter CI runs: ruff with the rules in pyproject.toml ([tool.ruff.lint]) over every Python file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True)
    assert "No module named ruff" not in proc.stderr, "ruff is a test dependency: re-run make setup"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
