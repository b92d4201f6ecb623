"""The pinned upstream: ggml-patches/upstream.lock names the llama-cpp-python sdist and its SHA-256;
pip downloads it into the cache, and it is unpacked into a git repo whose first commit, tagged
``pristine``, is upstream as released."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import PATCH_DIR, SetupError, git, log, read_stamp, write_stamp
from rotaryquant.build.tree import LINKS, tree_state_path
from rotaryquant.build.venv import pip
from rotaryquant.files import sha256

LOCK_FILE = PATCH_DIR / "upstream.lock"


@dataclass(frozen=True)
class Lock:
    package: str
    version: str
    sdist: str
    sha256: str
    llama_cpp_commit: str = ""  # upstream llama.cpp's commit inside the sdist (labels the web UI build)


def read_lock() -> Lock:
    kv = {}
    for line in LOCK_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            k, v = (s.strip() for s in line.split("=", 1))
            kv[k] = v
    return Lock(kv["package"], kv["version"], kv["sdist"], kv["sha256"], kv.get("llama_cpp_commit", ""))


def fetch_sdist(lock: Lock) -> Path:
    dl = paths.cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    target = dl / lock.sdist
    if target.exists() and sha256(target) == lock.sha256:
        return target
    target.unlink(missing_ok=True)
    log(f"downloading {lock.package}=={lock.version} (source distribution) with pip")
    with tempfile.TemporaryDirectory(dir=dl) as tmp:
        # --no-build-isolation: pip only reads the sdist's metadata; the back-end is in the venv
        pip("download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
            "-d", tmp, f"{lock.package}=={lock.version}",
            what=f"pip download {lock.package}=={lock.version}")
        got = Path(tmp) / lock.sdist
        if not got.exists():
            raise SetupError(f"pip did not produce {lock.sdist}; check {LOCK_FILE}")
        digest = sha256(got)
        if digest != lock.sha256:
            raise SetupError(f"checksum mismatch for {lock.sdist}: got {digest}, expected "
                             f"{lock.sha256} (from {LOCK_FILE}); the download is corrupt or the "
                             "index serves a different file: delete the cache and retry, or update "
                             "the lock only after checking the new file")
        got.replace(target)
    return target


def unpack(lock: Lock, sdist: Path) -> None:
    root = paths.src_root()
    state = read_stamp(tree_state_path())
    if root.exists() and state.get("sdist_sha256") == lock.sha256 and (root / ".git").exists():
        return
    log(f"unpacking {sdist.name} -> {root}")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".unpack-"))
    try:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        (inner,) = [p for p in tmp.iterdir() if p.is_dir()]
        # the sdist carries vendor/llama.cpp/.git (a dangling submodule link): without removing it
        # git would record the whole llama.cpp tree as one opaque gitlink
        for nested in inner.rglob(".git"):
            if nested.is_dir():
                shutil.rmtree(nested)
            else:
                nested.unlink()
        git(inner, "init", "-q", "-b", "main")
        git(inner, "add", "-A", "-f")
        git(inner, "commit", "-q", "--no-verify", "-m", f"pristine {lock.package} {lock.version}")
        git(inner, "tag", "pristine")
        excl = inner / ".git" / "info" / "exclude"
        excl.parent.mkdir(parents=True, exist_ok=True)
        excl.write_text("".join(f"/{p}\n" for p in LINKS) + "/llama_cpp/lib/\n")
        shutil.rmtree(root, ignore_errors=True)
        inner.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_stamp(tree_state_path(), {"sdist_sha256": lock.sha256})
