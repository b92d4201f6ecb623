"""rq-setup: fetch the pinned llama.cpp, apply ggml-patches/, build it, wire Python to it.

Runs with the system Python (stdlib only) before any virtual environment exists:

    python3 -m rotaryquant.build setup        # everything below, idempotent
    python3 -m rotaryquant.build export-patches   # upstream tree edits -> ggml-patches/*.patch

Every step is skipped when its stamp says it is done; every failure is one line that says
what failed and how to fix it, and leaves nothing half-done that a re-run would trust.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import paths
from rotaryquant.files import sha256

PATCH_DIR = Path(os.environ.get("RQ_PATCH_DIR", paths.REPO / "ggml-patches"))
LOCK_FILE = PATCH_DIR / "upstream.lock"

# Our sources, linked into the upstream tree (link path relative to the sdist root -> repo path).
LINKS = {
    "vendor/llama.cpp/ggml/src/ggml-rq": PATCH_DIR / "src",
    "vendor/llama.cpp/ggml/include/ggml-rq.h": PATCH_DIR / "include" / "ggml-rq.h",
}

# What the default build produces (ninja targets).
TARGETS = [
    "llama", "ggml", "ggml-base", "ggml-cpu", "ggml-rpc", "mtmd",
    "llama-cli", "llama-completion", "llama-server", "llama-bench", "llama-perplexity",
    "llama-quantize", "llama-imatrix", "ggml-rpc-server",
    "test-backend-ops", "test-quantize-fns",
    "rq-tests",
]
CUDA_TARGETS = ["ggml-cuda"]

# x86-64-v3, not -march=native (see CMakeLists.txt); --cmake-arg=-DGGML_NATIVE=ON overrides
PORTABLE_CPU = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON"] if platform.machine() in ("x86_64", "AMD64") else []

GIT_ID = ["-c", "user.name=rotaryquant", "-c", "user.email=rotaryquant@localhost",
          "-c", "core.autocrlf=false", "-c", "advice.detachedHead=false"]


class SetupError(RuntimeError):
    """A failed step: the message says what failed and how to fix it."""


def log(msg: str) -> None:
    print(f"[rq-setup] {msg}", flush=True)


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


# --------------------------------------------------------------------------------------------
# upstream lock and patch series

@dataclass(frozen=True)
class Lock:
    package: str
    version: str
    sdist: str
    sha256: str


def read_lock() -> Lock:
    kv = {}
    for line in LOCK_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            k, v = (s.strip() for s in line.split("=", 1))
            kv[k] = v
    return Lock(kv["package"], kv["version"], kv["sdist"], kv["sha256"])


def patch_series() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def series_hash() -> str:
    h = hashlib.sha256()
    for p in patch_series():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# steps

def check_tools() -> None:
    missing = [t for t in ("git", "cc", "c++") if shutil.which(t) is None]
    if missing:
        raise SetupError(f"missing tools: {', '.join(missing)}; install them "
                         "(Debian: apt-get install build-essential git)")


def ensure_ccache() -> None:
    if shutil.which("ccache"):
        return
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        log("installing ccache (apt-get)")
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "ccache"], capture_output=True)
        if proc.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            proc = subprocess.run(["apt-get", "install", "-y", "-q", "ccache"], capture_output=True)
        if proc.returncode == 0:
            return
    log("note: ccache not available; builds will not be cached (apt-get install ccache)")


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
    # the venv's scripts hard-code the temporary path; recreate them at the final path
    run([sys.executable, "-m", "venv", "--upgrade", str(paths.venv_dir())],
        what="finalising the virtual environment", fix="remove .venv and re-run", quiet=True)


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


def ensure_python_deps() -> None:
    deps, test = pyproject_requirements()
    # build back-ends used with --no-build-isolation below, and cmake/ninja if the system lacks them
    boot = ["scikit-build-core>=0.9.2", "poetry-core>=1.0.0", "setuptools>=68", "wheel"]
    if shutil.which("ninja") is None:
        boot.append("ninja")
    if not cmake_ok(shutil.which("cmake")):
        boot.append("cmake>=3.21")
    want = sorted(set(boot + deps + test))
    stamp_path = paths.venv_dir() / ".rq-deps.json"
    if read_stamp(stamp_path).get("want") == want:
        return
    log(f"installing Python dependencies ({len(want)} packages)")
    pip("install", "-q", *want, what="installing Python dependencies")
    write_stamp(stamp_path, {"want": want})


def cmake_ok(exe: str | None) -> bool:
    if not exe:
        return False
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    m = re.search(r"(\d+)\.(\d+)", out)
    return bool(m) and (int(m[1]), int(m[2])) >= (3, 21)


def cmake_exe() -> str:
    venv_cmake = paths.venv_dir() / "bin" / "cmake"
    if venv_cmake.exists():
        return str(venv_cmake)
    exe = shutil.which("cmake")
    if not cmake_ok(exe):
        raise SetupError("CMake >= 3.21 not found; install it (apt-get install cmake, or pip install cmake)")
    return exe  # type: ignore[return-value]


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


def tree_state_path() -> Path:
    return paths.src_root().parent / ".rq-tree.json"


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


def tree_has_local_edits(root: Path, head: str | None) -> bool:
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    return bool(dirty) or git(root, "rev-parse", "HEAD") != head


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


def link_sources() -> None:
    root = paths.src_root()
    for rel, target in LINKS.items():
        link = root / rel
        if link.is_symlink() and link.resolve() == target.resolve():
            continue
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        link.symlink_to(target)


def cmake_env() -> dict[str, str]:
    env = dict(os.environ)
    # ccache hits across clones at other paths (CI checks out fresh clones)
    env.setdefault("CCACHE_BASEDIR", str(paths.REPO))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    venv_bin = str(paths.venv_dir() / "bin")
    env["PATH"] = env.get("PATH", "") + os.pathsep + venv_bin  # ninja/cmake from pip, if needed
    return env


def configure_and_build(flavour: str, extra: list[str], jobs: int | None, targets: list[str]) -> None:
    bdir = paths.cmake_build_dir(flavour)
    args = [f"-DRQ_LLAMA_DIR={paths.llama_root()}", "-DCMAKE_BUILD_TYPE=Release", *PORTABLE_CPU, *extra]
    stamp_path = bdir / ".rq-configure.json"
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=cmake_env()["PATH"]) else []
    env = cmake_env()
    if read_stamp(stamp_path).get("args") != args or not (bdir / "CMakeCache.txt").exists():
        log(f"configuring {bdir}")
        bdir.mkdir(parents=True, exist_ok=True)
        run([cmake_exe(), "-S", str(paths.REPO), "-B", str(bdir), *gen, *args], env=env,
            what="cmake configure", fix=f"see the CMake output above (log: {bdir}/CMakeFiles)", quiet=True)
        write_stamp(stamp_path, {"args": args})
    log(f"building {len(targets)} targets in {bdir} (incremental)")
    t0 = time.time()
    cmd = [cmake_exe(), "--build", str(bdir), "--target", *targets]
    if jobs:
        cmd += ["-j", str(jobs)]
    run(cmd, env=env, what="the llama.cpp build", fix="see the compiler output above")
    log(f"build done in {time.time() - t0:.0f} s")


def tree_fingerprint() -> str:
    root = paths.src_root()
    h = hashlib.sha256(git(root, "rev-parse", "HEAD").encode())
    h.update(git(root, "diff", "HEAD", "--", "llama_cpp", "vendor/llama.cpp/gguf-py").encode())
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
        env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
        pip("install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall", str(root),
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


# --------------------------------------------------------------------------------------------
# commands

CUBLAS_PIN = "nvidia-cublas==13.1.1.3"  # cu13, matches nvcc 13.0 (docs/cuda.md)


def cuda_cmake_args() -> list[str]:
    """-DGGML_CUDA=ON extras: sm_90 unless RQ_CUDA_ARCHS, no libcuda, cuBLAS from the pinned wheel when the
    toolkit lacks it (this machine's CUDA has cudart only)."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        raise SetupError("--cuda needs nvcc (CUDA 13); install the CUDA toolkit or put nvcc on PATH")
    args = [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('RQ_CUDA_ARCHS', '90')}",
            "-DGGML_CUDA_NO_VMM=ON"]
    root = Path(nvcc).resolve().parent.parent
    if (root / "include" / "cublas_v2.h").exists() and any((root / "lib64").glob("libcublas.so*")):
        return args
    deps = paths.build_dir() / "cuda-deps"
    lib = deps / "lib"
    if not (deps / "include" / "cublas_v2.h").exists() or not (lib / "libcublasLt.so").exists():
        log(f"fetching cuBLAS ({CUBLAS_PIN}) into {deps}")
        wheel_dir = deps / "wheel"
        shutil.rmtree(wheel_dir, ignore_errors=True)
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir), CUBLAS_PIN,
            what=f"pip download {CUBLAS_PIN}")
        with zipfile.ZipFile(next(wheel_dir.glob("nvidia_cublas-*.whl"))) as z:
            for m in z.namelist():
                for sub in ("include", "lib"):
                    pre = f"nvidia/cu13/{sub}/"
                    if m.startswith(pre) and not m.endswith("/"):
                        out = deps / sub / m[len(pre):]
                        out.parent.mkdir(parents=True, exist_ok=True)
                        with z.open(m) as src, open(out, "wb") as dst:
                            shutil.copyfileobj(src, dst)
        shutil.rmtree(wheel_dir)
        for name in ("libcublas", "libcublasLt"):
            (lib / f"{name}.so").unlink(missing_ok=True)
            (lib / f"{name}.so").symlink_to(f"{name}.so.13")
    return args + [f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}",
                   f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so'}",
                   f"-DCMAKE_CUDA_FLAGS=-I{deps / 'include'}"]


def cmd_setup(ns: argparse.Namespace) -> None:
    check_tools()
    ensure_ccache()
    ensure_venv()
    ensure_python_deps()
    lock = read_lock()
    sdist = fetch_sdist(lock)
    unpack(lock, sdist)
    apply_patches(lock)
    extra = list(ns.cmake_arg or [])
    targets = TARGETS
    if ns.cuda:
        extra += ["-DGGML_CUDA=ON", *cuda_cmake_args()]
        targets = TARGETS + CUDA_TARGETS
    configure_and_build(ns.flavour or ("cuda" if ns.cuda else "cpu"), extra, ns.jobs, targets)
    install_python(ns.flavour or ("cuda" if ns.cuda else "cpu"))
    if not ns.no_assets:
        from rotaryquant import assets
        assets.ensure_default_assets(python=str(venv_python()))
    log("ready")


def cmd_patch(ns: argparse.Namespace) -> None:
    check_tools()
    ensure_venv()
    ensure_python_deps()
    lock = read_lock()
    unpack(lock, fetch_sdist(lock))
    apply_patches(lock)
    log(f"patched tree: {paths.src_root()}")


def cmd_export(ns: argparse.Namespace) -> None:
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
        git(root, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-numbered",
            "--full-index", "-o", tmp, "pristine..HEAD", what="git format-patch")
        new = sorted(Path(tmp).glob("*.patch"))
        for old in patch_series():
            old.unlink()
        for p in new:
            shutil.copy(p, PATCH_DIR / p.name)
    state = read_stamp(tree_state_path())
    state.update(series=series_hash(), head=git(root, "rev-parse", "HEAD"))
    write_stamp(tree_state_path(), state)
    log(f"exported {len(new)} patches to {PATCH_DIR}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rq-setup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="venv, fetch, patch, build, install (idempotent)")
    s.add_argument("--cuda", action="store_true", help="also build the CUDA backend (-DGGML_CUDA=ON)")
    s.add_argument("--flavour", help="build folder name under build/ (default: cpu, or cuda with --cuda)")
    s.add_argument("--cmake-arg", action="append", help="extra CMake argument (repeatable)")
    s.add_argument("-j", "--jobs", type=int, help="parallel build jobs (default: all cores)")
    s.add_argument("--no-assets", action="store_true", help="skip the default model and text")
    s.set_defaults(fn=cmd_setup)
    p = sub.add_parser("patch", help="fetch the sdist and apply ggml-patches/ (no build)")
    p.set_defaults(fn=cmd_patch)
    e = sub.add_parser("export-patches", help="write the upstream tree's commits since `pristine` "
                                              "back to ggml-patches/*.patch")
    e.set_defaults(fn=cmd_export)
    ns = ap.parse_args(argv)
    try:
        ns.fn(ns)
    except SetupError as e:
        print(f"rq-setup: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rq-setup: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
