"""llama.cpp builds side by side: ours, stock llama.cpp, and forks, each named on the command line as NAME=BIN_DIR.

A build is a CMake build folder's bin/ with its own tools (llama-perplexity, ...) and shared libllama. Each is
measured through its own programs, and through rq-probe (probe/rq-probe.cpp): our one measurement program,
compiled here against the build's own llama.h and linked to its own libllama, so that prefill, teacher-forced
decode and needle questions run the same steps in every build. Where a build's API differs the probe has a
compile-time switch, read from the build's llama.h; where a build lacks a flag the probe refuses it by name.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rotaryquant import paths
from rotaryquant.errors import RQError

PROBE_SRC = Path(__file__).with_name("probe") / "rq-probe.cpp"

# llama.h text -> the probe's compile-time switch (see rq-probe.cpp's header)
_FEATURES = {
    "RQ_PROBE_FA_TYPE": re.compile(r"enum\s+llama_flash_attn_type\s+flash_attn_type\s*;"),
    "RQ_PROBE_BATCH4": re.compile(r"llama_batch_get_one\(\s*llama_token\s*\*\s*tokens,\s*int32_t\s+n_tokens,\s*"
                                  r"llama_pos\s+pos_0"),
    "RQ_PROBE_HAD": re.compile(r"\bbool\s+k_cache_hadamard\s*;"),
    "RQ_PROBE_RQ": re.compile(r"\bint32_t\s+kv_window\s*;"),
    "RQ_PROBE_SWA_FULL": re.compile(r"\bbool\s+swa_full\s*;"),
    "RQ_PROBE_KSTATS": re.compile(r"\bconst\s+char\s*\*\s*k_stats_path\s*;"),
    "RQ_PROBE_SEQ": re.compile(r"\A(?=.*\bbool\s+kv_unified\s*;)(?=.*\bllama_memory_seq_cp\s*\()", re.S),
    "RQ_PROBE_SEQ_KV": re.compile(r"\bllama_kv_cache_seq_cp\s*\("),
}
# environment variables that change what a build's flags mean: cleared for every run, so each runs its defaults
CLEARED_ENV = ("LLAMA_", "GGML_ISOQUANT_", "GGML_RQ_", "TURBO_")


class BuildError(RQError):
    """A build folder that cannot be measured: missing tools or libraries, or the probe does not compile."""


@dataclass(frozen=True)
class Build:
    name: str
    bin_dir: Path
    src: Path  # the llama.cpp source it was built from (include/llama.h, ggml/include)
    lib_dirs: tuple[Path, ...] = ()  # where its libllama and libggml* are (bin/ upstream; src/, ggml/src/ in older trees)
    commit: str | None = None
    features: frozenset[str] = field(default_factory=frozenset)

    def tool(self, *names: str) -> Path:
        """The first of names this build has (llama-completion is llama-cli in older trees)."""
        for n in names:
            if (self.bin_dir / n).exists():
                return self.bin_dir / n
        raise BuildError(f"build {self.name} ({self.bin_dir}) has none of {', '.join(names)}",
                         fix="build those targets in that folder")

    def log_flags(self, tool: str) -> list[str]:
        """What makes the tool log libllama's info lines (the KV cache size): newer tools print only warnings unless
        asked (-lv 4); older ones print everything."""
        h = subprocess.run([str(self.tool(tool)), "--help"], capture_output=True, text=True, env=run_env())
        return ["-lv", "4"] if "-lv," in h.stdout + h.stderr else []

    def describe(self) -> dict:
        return {"name": self.name, "bin_dir": str(self.bin_dir), "src": str(self.src), "commit": self.commit,
                "features": sorted(self.features), "cmake": cmake_flags(self.bin_dir.parent)}


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The machine a result was measured on: its CPU's name, and whether our IsoQuant attention kernels can take
    their AVX-512 path there (VNNI and BF16 both; otherwise the float AVX2 kernels run)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return {"model": name.group(1).strip() if name else None,
            "avx512_vnni_bf16": {"avx512_vnni", "avx512_bf16"} <= set(flags.group(1).split() if flags else ())}


def parse(spec: str) -> Build:
    """'NAME=BIN_DIR' -> Build; BuildError naming what is missing."""
    name, eq, where = spec.partition("=")
    if not eq or not name.strip() or not re.fullmatch(r"[A-Za-z0-9_.-]+", name.strip()):
        raise BuildError(f"--build takes NAME=BIN_DIR (NAME of letters, digits, '._-'), got {spec!r}")
    bin_dir = Path(where).expanduser().resolve()
    libs = tuple(d for d in (bin_dir, bin_dir.parent / "src", bin_dir.parent / "ggml" / "src", bin_dir.parent / "lib")
                 if any(d.glob("libllama.so")) or any(d.glob("libggml*.so")))
    if not any((d / "libllama.so").exists() for d in libs):
        raise BuildError(f"build {name}: no libllama.so in {bin_dir} or beside it",
                         fix="give the bin folder of a CMake build made with -DBUILD_SHARED_LIBS=ON")
    src = source_dir(bin_dir.parent)
    header = (src / "include" / "llama.h").read_text(errors="replace")
    feats = frozenset(k for k, rx in _FEATURES.items() if rx.search(header))
    return Build(name.strip(), bin_dir, src, libs, _commit(src), feats)


def ours() -> Build:
    """build/cpu/bin, its commit this checkout's (the tree it is built from is upstream's plus our patches), marked
    "+changes" when our kernel or library sources differ from that commit (what ran is then not what it names)."""
    b = parse(f"ours={paths.bin_dir('cpu')}")
    commit = _commit(paths.REPO)
    r = subprocess.run(["git", "-C", str(paths.REPO), "status", "--porcelain", "--", "ggml-patches", "CMakeLists.txt"],
                       capture_output=True, text=True)
    if commit and r.returncode == 0 and r.stdout.strip():
        commit += "+changes"
    return Build(b.name, b.bin_dir, b.src, b.lib_dirs, commit, b.features)


def source_dir(build_dir: Path) -> Path:
    """The llama.cpp source a CMake build folder was configured from (its CMakeCache's ggml_SOURCE_DIR's parent)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        raise BuildError(f"{build_dir} is not a CMake build folder (no CMakeCache.txt)")
    m = re.search(r"^ggml_SOURCE_DIR:STATIC=(.*)$", cache.read_text(errors="replace"), re.M)
    src = Path(m.group(1)).parent if m else None
    if src is None or not (src / "include" / "llama.h").exists():
        raise BuildError(f"{build_dir}: cannot find the llama.cpp source it was built from (include/llama.h)",
                         fix="measure a build whose source folder still exists")
    return src


def cmake_flags(build_dir: Path) -> dict[str, str]:
    """The settings a comparison must state: build type, CPU flags, OpenMP."""
    try:
        text = (build_dir / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return {}
    keep = re.compile(r"^(CMAKE_BUILD_TYPE|CMAKE_C_FLAGS|CMAKE_CXX_FLAGS|GGML_NATIVE|GGML_AVX\w*|GGML_FMA|GGML_F16C|"
                      r"GGML_BMI2|GGML_OPENMP|GGML_IQK\w*|CMAKE_C_COMPILER):\w+=(.*)$", re.M)
    return {k: v for k, v in keep.findall(text)}


def _commit(src: Path) -> str | None:
    for d in (src, *src.parents):
        if (d / ".git").exists():
            r = subprocess.run(["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True)
            return r.stdout.strip() or None if r.returncode == 0 else None
    return None


def _fresh(folder: Path, prefix: str) -> Path:
    """A new empty file of this caller's own in folder (unique across processes and threads)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".partial", dir=folder)
    os.close(fd)
    return Path(name)


def probe(build: Build) -> Path:
    """rq-probe compiled for this build (cached by source, header and library content)."""
    h = hashlib.sha256(PROBE_SRC.read_bytes())
    libllama = next(d / "libllama.so" for d in build.lib_dirs if (d / "libllama.so").exists())
    for f in (build.src / "include" / "llama.h", libllama):
        h.update(f.read_bytes())
    out = paths.build_dir() / "probe" / build.name / h.hexdigest()[:16] / "rq-probe"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    cmd = [cxx, "-O2", "-std=c++17", *(f"-D{f}" for f in sorted(build.features)), str(PROBE_SRC),
           "-I", str(build.src / "include"), "-I", str(build.src / "ggml" / "include"),
           *(x for d in build.lib_dirs for x in ("-L", str(d), f"-Wl,-rpath,{d}")), "-lllama", "-lggml",
           *(["-lggml-base"] if any((d / "libggml-base.so").exists() for d in build.lib_dirs) else []),
           "-o", str(tmp := _fresh(out.parent, "rq-probe."))]
    # a file of this process's own, renamed whole: runs started together (needles in parallel) each compile, and
    # none executes or replaces a file another is still writing
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(r.stderr.strip().splitlines()[-12:])
        raise BuildError(f"rq-probe does not compile against build {build.name} ({build.src}):\n{tail}")
    tmp.replace(out)
    return out


def run_env() -> dict[str, str]:
    """The environment every build's program runs in: ours and theirs alike, without settings that change flags."""
    return {k: v for k, v in os.environ.items() if not k.startswith(CLEARED_ENV)}
