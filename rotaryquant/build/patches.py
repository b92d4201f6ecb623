"""The patch series, ggml-patches/*.patch: applied in order onto ``pristine`` (git am, one commit
per patch) and exported back from the tree's commits (git format-patch)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import GIT_ID, PATCH_DIR, SetupError, git, log, read_stamp, write_stamp
from rotaryquant.build.sdist import Lock
from rotaryquant.build.tree import link_sources, tree_has_local_edits, tree_state_path


def patch_series() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def series_hash() -> str:
    h = hashlib.sha256()
    for p in patch_series():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def apply_patches(lock: Lock) -> None:
    root = paths.src_root()
    state = read_stamp(tree_state_path())
    want = series_hash()
    if state.get("series") == want:
        if tree_has_local_edits(root, state.get("head")):
            log("the upstream tree has local edits: building them as they are "
                "(export them with `make patches`)")
        link_sources()
        return
    if state.get("head") and tree_has_local_edits(root, state.get("head")):
        raise SetupError(f"ggml-patches/ changed, but {root} has local edits that were not exported; "
                         "export them first (`make patches`), or discard them with "
                         f"`git -C {root} reset --hard pristine`")
    log(f"applying {len(patch_series())} patches from ggml-patches/")
    git(root, "reset", "-q", "--hard", "pristine")
    git(root, "clean", "-q", "-fdx", "-e", "/llama_cpp/lib/")
    try:
        apply_series(root, patch_series(), lock)
    except SetupError:
        git(root, "reset", "-q", "--hard", "pristine")
        write_stamp(tree_state_path(), {"sdist_sha256": lock.sha256})
        raise
    write_stamp(tree_state_path(), {"sdist_sha256": lock.sha256, "series": want,
                                    "head": git(root, "rev-parse", "HEAD")})
    link_sources()


def apply_series(root: Path, patches: list[Path], lock: Lock) -> None:
    """git am each patch in order onto root; a patch that does not apply is named in the error."""
    for patch in patches:
        proc = subprocess.run(["git", *GIT_ID, "am", "-q", "--keep-cr", "--committer-date-is-author-date",
                               str(patch)], cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["git", "am", "--abort"], cwd=root, capture_output=True)
            detail = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
            raise SetupError(f"patch {patch.name} does not apply to {lock.package} {lock.version} "
                             f"({detail[0] if detail else 'git am failed'}); rebase it on the "
                             "pinned tree, see CONTRIBUTING.md")


def format_series(root: Path, out: Path) -> list[Path]:
    """The tree's commits since ``pristine`` as patch files in out (what `make patches` writes), in order."""
    git(root, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-numbered",
        "--full-index", "-o", str(out), "pristine..HEAD", what="git format-patch")
    return sorted(out.glob("*.patch"))


def export_patches() -> None:
    """The tree's commits since ``pristine`` -> ggml-patches/*.patch (the series is replaced)."""
    root = paths.src_root()
    if not (root / ".git").exists():
        raise SetupError(f"no upstream tree at {root}; run `make setup` first")
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise SetupError(f"{root} has uncommitted edits; commit them there first "
                         "(`git commit -a --amend` into the patch they belong to, or a new commit)")
    untracked = git(root, "status", "--porcelain")
    if untracked:
        log("note: untracked files in the tree are not exported:\n" + untracked)
    with tempfile.TemporaryDirectory() as tmp:
        new = format_series(root, Path(tmp))
        for old in patch_series():
            old.unlink()
        for p in new:
            shutil.copy(p, PATCH_DIR / p.name)
    state = read_stamp(tree_state_path())
    state.update(series=series_hash(), head=git(root, "rev-parse", "HEAD"))
    write_stamp(tree_state_path(), state)
    log(f"exported {len(new)} patches to {PATCH_DIR}")
