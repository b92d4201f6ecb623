"""Wire Python to the build: install the patched gguf-py, llama-cpp-python from the patched tree
(without its own llama.cpp build) and rotaryquant (editable) into the venv, then point llama_cpp's
lib/ at the libraries we built."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import PATCH_DIR, SetupError, git, log, read_stamp, run, write_stamp
from rotaryquant.build.tree import packaging_args
from rotaryquant.build.venv import pip, venv_python
from rotaryquant.files import sha256


def tree_fingerprint() -> str:
    root = paths.src_root()
    h = hashlib.sha256(git(root, "rev-parse", "HEAD").encode())
    h.update(git(root, "diff", "HEAD", "--", "llama_cpp", "vendor/llama.cpp/gguf-py").encode())
    for src in sorted((PATCH_DIR / "src" / "python").glob("*.py")):  # linked into llama_cpp (tree.LINKS)
        h.update(src.read_bytes())
    return h.hexdigest()


def install_python(flavour: str) -> None:
    root = paths.src_root()
    stamp_path = paths.venv_dir() / ".rq-python.json"
    want = {"tree": tree_fingerprint(), "flavour": flavour,
            "pyproject": sha256(paths.REPO / "pyproject.toml")}
    if read_stamp(stamp_path) != want:
        log("installing the patched gguf-py, llama-cpp-python (no second llama.cpp build) and rotaryquant")
        pip("install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall",
            str(root / "vendor" / "llama.cpp" / "gguf-py"), what="installing the vendored gguf-py")
        env, linked = packaging_args()
        pip("install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall", *linked, str(root),
            what="installing llama-cpp-python from the patched tree", env=env)
        pip("install", "-q", "--no-deps", "--no-build-isolation", "-e", str(paths.REPO),
            what="installing rotaryquant (editable)")
        write_stamp(stamp_path, want)
    link_libraries(flavour)


def site_llama_cpp() -> Path:
    out = run([str(venv_python()), "-c", "import importlib.util as u, pathlib; "
               "print(pathlib.Path(u.find_spec('llama_cpp').origin).parent)"],
              what="locating llama_cpp", fix="re-run set-up", quiet=True).stdout
    return Path(out.strip().splitlines()[-1])


def link_libraries(flavour: str) -> None:
    """llama_cpp loads lib/libllama.so next to itself: point it at our build (symlinks, so that
    an incremental rebuild is live at once; libggml* resolve through the build's RUNPATH)."""
    libdir = site_llama_cpp() / "lib"
    libdir.mkdir(exist_ok=True)
    built = sorted(paths.bin_dir(flavour).glob("lib*.so"))
    if not any(p.name == "libllama.so" for p in built):
        raise SetupError(f"no libllama.so in {paths.bin_dir(flavour)}; the build did not finish")
    for old in libdir.iterdir():
        if old.is_symlink() or old.suffix == ".so" or ".so." in old.name:
            old.unlink()
    for lib in built:
        (libdir / lib.name).symlink_to(lib)
