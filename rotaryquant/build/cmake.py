"""Configure and build the patched llama.cpp with our CMakeLists.txt (Ninja when available, ccache
across clones), portable x86-64-v3 CPU flags, and the CUDA / Vulkan extras for ``setup --cuda`` / ``--vulkan``."""

from __future__ import annotations

import os
import platform
import shutil
import time
import zipfile
from pathlib import Path

from rotaryquant import paths
from rotaryquant.build.common import SetupError, log, read_stamp, run, write_stamp
from rotaryquant.build.tools import cmake_exe
from rotaryquant.build.venv import pip

# What the default build produces (ninja targets).
TARGETS = [
    "llama", "ggml", "ggml-base", "ggml-cpu", "ggml-rpc", "mtmd",
    "llama-cli", "llama-completion", "llama-server", "llama-bench", "llama-perplexity",
    "llama-quantize", "llama-imatrix", "ggml-rpc-server",
    "test-backend-ops", "test-quantize-fns",
    "rq-tests",
]
# What `make demo` runs (setup --demo): the libraries llama_cpp loads and llama-imatrix; the rest (llama-server and its
# web UI, the other tools, the test programs) waits for the first full set-up (make test)
DEMO_TARGETS = ["llama", "ggml", "llama-imatrix"]
CUDA_TARGETS = ["ggml-cuda"]
VULKAN_TARGETS = ["ggml-vulkan", "test-rq-vulkan"]

# x86-64-v3, not -march=native (see CMakeLists.txt); --cmake-arg=-DGGML_NATIVE=ON overrides
PORTABLE_CPU = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON"] if platform.machine() in ("x86_64", "AMD64") else []

CUBLAS_PIN = "nvidia-cublas==13.1.1.3"  # cu13, matches nvcc 13.0 (docs/cuda.md)


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
