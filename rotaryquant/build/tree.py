"""The unpacked upstream tree (build/src/llama-cpp-python, a git repo tagged ``pristine``): its state
stamp, whether it carries edits not yet exported, and the links that put our sources into it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import PATCH_DIR, git

# Our sources, linked into the upstream tree (link path relative to the sdist root -> repo path).
LINKS = {
    "vendor/llama.cpp/ggml/src/ggml-rq": PATCH_DIR / "src",
    "vendor/llama.cpp/ggml/include/ggml-rq.h": PATCH_DIR / "include" / "ggml-rq.h",
    "vendor/llama.cpp/src/llama-rq": PATCH_DIR / "src" / "llama",
    "llama_cpp/llama_rq.py": PATCH_DIR / "src" / "python" / "llama_rq.py",
}


def tree_state_path() -> Path:
    return paths.src_root().parent / ".rq-tree.json"


def tree_has_local_edits(root: Path, head: str | None) -> bool:
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    return bool(dirty) or git(root, "rev-parse", "HEAD") != head


def packaging_args() -> tuple[dict[str, str], list[str]]:
    """pip's environment and config settings for packaging the tree's llama_cpp (install or wheel) without building
    llama.cpp a second time; our modules linked into llama_cpp are git-excluded in the tree, which scikit-build-core
    would leave out, so they are included by name."""
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    return env, [f"-Csdist.include={rel}" for rel in LINKS if rel.startswith("llama_cpp/")]


def link_sources() -> None:
    root = paths.src_root()
    excl = root / ".git" / "info" / "exclude"  # a tree unpacked before a link was added: git must not list it
    if excl.exists():
        have = excl.read_text().splitlines()
        excl.write_text("".join(ln + "\n" for ln in have + [f"/{p}" for p in LINKS if f"/{p}" not in have]))
    for rel, target in LINKS.items():
        link = root / rel
        if link.is_symlink() and link.resolve() == target.resolve():
            continue
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        link.symlink_to(target)
