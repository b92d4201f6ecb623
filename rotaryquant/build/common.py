"""What every set-up step uses: where ggml-patches/ is, the error type, the log line, subprocesses
and git with one-line failures, and the JSON stamps that make each step skippable."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rotaryquant import paths
from rotaryquant.errors import RQError

PATCH_DIR = Path(os.environ.get("RQ_PATCH_DIR", paths.REPO / "ggml-patches"))

GIT_ID = ["-c", "user.name=rotaryquant", "-c", "user.email=rotaryquant@localhost",
          "-c", "core.autocrlf=false", "-c", "advice.detachedHead=false"]


class SetupError(RQError):
    """A failed step: the message says what failed and how to fix it."""


def log(msg: str) -> None:
    print(f"[rq-setup] {msg}", flush=True)


class Phases:
    """Wall time per set-up phase, for the one summary line at the end (docs/setup.md's table comes from it)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.spent: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.time()
        try:
            yield
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.time() - t

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in self.spent.items())
        return f"phases: {parts}; total {time.time() - self.t0:.0f} s"


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
        what: str, fix: str, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE if quiet else None,
                              stderr=subprocess.STDOUT if quiet else None)
    except FileNotFoundError as e:
        raise SetupError(f"{what}: {e.filename} not found; {fix}") from None
    if proc.returncode != 0:
        if quiet and proc.stdout:
            sys.stdout.write(proc.stdout[-4000:])
        raise SetupError(f"{what} failed (exit {proc.returncode}); {fix}")
    return proc


def git(tree: Path, *args: str, what: str = "git", fix: str = "see the git output above",
        quiet: bool = True) -> str:
    proc = run(["git", *GIT_ID, *args], cwd=tree, what=what, fix=fix, quiet=quiet)
    return (proc.stdout or "").strip()


def read_stamp(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_stamp(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
