"""The virtual environment: created with the system Python, filled with pyproject.toml's
dependencies (minus gguf and llama-cpp-python, which come from the patched tree) and the build
back-ends, all through pip."""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import log, read_stamp, run, write_stamp
from rotaryquant.build.tools import cmake_ok


def venv_python() -> Path:
    return paths.venv_dir() / "bin" / "python"


def ensure_venv() -> None:
    py = venv_python()
    if py.exists():
        return
    log(f"creating virtual environment {paths.venv_dir()}")
    tmp = paths.venv_dir().with_name(paths.venv_dir().name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(tmp)], what="creating the virtual environment",
        fix="install Python's venv module (Debian: apt-get install python3-venv)", quiet=True)
    tmp.rename(paths.venv_dir())
    # the venv's scripts hard-code the temporary path: --upgrade rewrites the activate scripts, not
    # the shebangs of the scripts ensurepip installed (pip, pip3, ...), so those are fixed here
    run([sys.executable, "-m", "venv", "--upgrade", str(paths.venv_dir())],
        what="finalising the virtual environment", fix="remove .venv and re-run", quiet=True)
    fix_shebangs(paths.venv_dir() / "bin", f"#!{tmp}/", f"#!{paths.venv_dir()}/")


def fix_shebangs(bin_dir: Path, old: str, new: str) -> None:
    for f in bin_dir.iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        with f.open("rb") as fh:
            head = fh.read(len(old))
        if head == old.encode():
            f.write_bytes(new.encode() + f.read_bytes()[len(old):])


def pyproject_requirements() -> tuple[list[str], list[str]]:
    """(runtime deps, test deps) from pyproject.toml, minus the two that come from the tree."""
    data = tomllib.loads((paths.REPO / "pyproject.toml").read_text())
    from_tree = re.compile(r"^(llama[-_]cpp[-_]python|gguf)\b", re.I)
    deps = [d for d in data["project"]["dependencies"] if not from_tree.match(d)]
    extras = data["project"].get("optional-dependencies", {})
    test = [d for d in extras.get("test", []) + extras.get("eval", []) if not from_tree.match(d)]
    return deps, test


def pip(*args: str, what: str, env: dict[str, str] | None = None) -> None:
    run([str(venv_python()), "-m", "pip", "--disable-pip-version-check", *args],
        env=env, what=what,
        fix="check that the package index is reachable (pip config list) and re-run", quiet=True)


def ensure_python_deps(test_deps: bool = True) -> None:
    """The runtime dependencies, and (test_deps) the test and eval extras too: torch alone is most of the download."""
    deps, test = pyproject_requirements()
    test = test if test_deps else []
    # build back-ends used with --no-build-isolation below, and cmake/ninja if the system lacks them
    boot = ["scikit-build-core>=0.9.2", "poetry-core>=1.0.0", "setuptools>=68", "wheel"]
    if shutil.which("ninja") is None:
        boot.append("ninja")
    if not cmake_ok(shutil.which("cmake")):
        boot.append("cmake>=3.21")
    want = sorted(set(boot + deps + test))
    stamp_path = paths.venv_dir() / ".rq-deps.json"
    have = read_stamp(stamp_path).get("want") or []
    if set(want) <= set(have):
        return
    log(f"installing Python dependencies ({len(want)} packages)")
    pip("install", "-q", *want, what="installing Python dependencies")
    write_stamp(stamp_path, {"want": want})
