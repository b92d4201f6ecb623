#!/usr/bin/env bash
# Compile-only check of the RotaryQuant CUDA code on a machine without a GPU (what CI can do).
#
#   scripts/cuda/ci-compile.sh [--tree DIR] [--build DIR] [--archs LIST] [-j N]
#
#   --tree   the patched llama-cpp-python tree (default build/src/llama-cpp-python, made by
#            `python3 -m rotaryquant.build setup` or `... patch`); it must carry patch 0008
#   --build  build folder (default build/cuda-ci)
#   --archs  CMAKE_CUDA_ARCHITECTURES (default 90: sm_90 code + compute_90 PTX; e.g. "75;90" adds Turing)
#
# Steps: (a) cuBLAS headers from the pinned NVIDIA wheel (pip, headers only) unless the CUDA toolkit
# has them, stub libcublas/libcublasLt for CMake (nothing is linked), no libcuda (GGML_CUDA_NO_VMM);
# (b) configure the repo's CMakeLists.txt for that tree with -DGGML_CUDA=ON; (c) build only the object
# files of our sources (ggml/src/ggml-rq/cuda/*.cu) and of the upstream units that patch 0008 touches,
# never the whole ggml-cuda (~40 min on 2 cores); (d) check that the bit-exact ISOQUANT3_0 unit was
# compiled without flush-to-zero and without contracted multiply-adds (its PTX). Exits non-zero on
# any error. Environment: NVCC (compiler), RQ_CUDA_DEPS (where the wheel's headers go, default
# build/cuda-deps), CCACHE_DISABLE=1 for a cold measurement.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TREE=$REPO/build/src/llama-cpp-python
BUILD=$REPO/build/cuda-ci
ARCHS=90
JOBS=$(nproc)
DEPS=${RQ_CUDA_DEPS:-$REPO/build/cuda-deps}
CUBLAS_PIN=nvidia-cublas==13.1.1.3   # cu13, matches nvcc 13.0 (docs/cuda.md)

while [ $# -gt 0 ]; do
    case $1 in
        --tree)  TREE=$(cd "$2" && pwd); shift 2 ;;
        --build) BUILD=$2; shift 2 ;;
        --archs) ARCHS=$2; shift 2 ;;
        -j)      JOBS=$2; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "ci-compile: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

die() { echo "ci-compile: error: $*" >&2; exit 1; }
log() { echo "[ci-compile] $*"; }
T0=$(date +%s)

LLAMA=$TREE/vendor/llama.cpp
[ -e "$LLAMA/ggml/src/ggml-rq/cuda/rq-cuda.cmake" ] || die "$TREE is not a patched tree (no ggml/src/ggml-rq/cuda); run 'python3 -m rotaryquant.build patch' or pass --tree"
grep -q "ggml-rq/cuda/rq-cuda.cmake" "$LLAMA/ggml/src/ggml-cuda/CMakeLists.txt" || die "$TREE lacks patch 0008 (ggml-cuda hooks)"

# ---- (a) toolchain and cuBLAS headers
NVCC=${NVCC:-}
if [ -z "$NVCC" ]; then
    for c in /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
        if [ -n "$c" ] && [ -x "$c" ]; then NVCC=$c; break; fi
    done
fi
[ -n "$NVCC" ] || die "nvcc not found (set NVCC=/path/to/nvcc)"
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
log "nvcc: $NVCC ($("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"

CMAKE_EXTRA=()
if [ -f "$CUDA_ROOT/include/cublas_v2.h" ] && ls "$CUDA_ROOT"/lib64/libcublas.so* >/dev/null 2>&1; then
    log "cuBLAS: from the toolkit ($CUDA_ROOT)"
else
    if [ ! -f "$DEPS/include/cublas_v2.h" ]; then
        log "cuBLAS headers: pip download $CUBLAS_PIN (headers only are kept)"
        rm -rf "$DEPS/wheel" && mkdir -p "$DEPS/wheel" "$DEPS/include"
        python3 -m pip download -q --no-deps --only-binary=:all: -d "$DEPS/wheel" "$CUBLAS_PIN" \
            || die "pip download $CUBLAS_PIN failed"
        unzip -q -o -j "$DEPS"/wheel/nvidia_cublas-*.whl 'nvidia/cu13/include/*' -d "$DEPS/include" \
            || die "unpacking the cuBLAS headers failed"
        rm -rf "$DEPS/wheel"
    fi
    # CMake wants library files to name; compiling objects never links, so empty stubs do
    mkdir -p "$DEPS/lib"
    for l in cublas cublasLt; do
        [ -f "$DEPS/lib/lib$l.so" ] || cc -shared -o "$DEPS/lib/lib$l.so" -x c /dev/null || die "cannot make a stub lib$l.so"
    done
    CMAKE_EXTRA+=(-DCUDA_cublas_LIBRARY="$DEPS/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$DEPS/lib/libcublasLt.so"
                  -DCMAKE_CUDA_FLAGS="-I$DEPS/include")
    log "cuBLAS: headers $DEPS/include, stub libraries (compile only)"
fi

# ---- (b) configure (same CPU flags as rotaryquant/build/cmake.py PORTABLE_CPU)
CPU_FLAGS=()
case $(uname -m) in
    x86_64|amd64) CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON) ;;
esac
log "configure $BUILD (CUDA archs $ARCHS)"
cmake -S "$REPO" -B "$BUILD" -G Ninja -Wno-dev \
    -DCMAKE_BUILD_TYPE=Release \
    -DRQ_LLAMA_DIR="$LLAMA" -DRQ_FUZZ=OFF \
    -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    "${CPU_FLAGS[@]}" "${CMAKE_EXTRA[@]}" >"$BUILD.configure.log" 2>&1 \
    || { tail -40 "$BUILD.configure.log"; die "cmake configure failed (log: $BUILD.configure.log)"; }

# ---- (c) the object files: ours + the upstream units patch 0008 touches
# only patch 0008 touches ggml-cuda: the tree's changes since `pristine` (edits not yet committed too),
# else the patch file
UPSTREAM=$(git -C "$TREE" diff --name-only pristine -- vendor/llama.cpp/ggml/src/ggml-cuda 2>/dev/null \
           | sed -n 's#.*/ggml-cuda/\([^/]*\.cu\)$#\1#p' | sort -u || true)
if [ -z "$UPSTREAM" ]; then
    PATCH=$(ls "$REPO"/ggml-patches/0008-cuda-*.patch 2>/dev/null | head -1)
    [ -n "$PATCH" ] || die "cannot tell which upstream units patch 0008 touches"
    UPSTREAM=$(sed -n 's#^diff --git a/.*/ggml-cuda/\([^/ ]*\.cu\) .*#\1#p' "$PATCH" | sort -u)
fi
ALL=$(ninja -C "$BUILD" -t targets all | sed -n 's#^\(.*ggml-cuda\.dir/.*\.cu\.o\): .*#\1#p')
OBJS=()
for f in $(cd "$LLAMA/ggml/src/ggml-rq/cuda" && ls *.cu); do
    o=$(grep "ggml-rq/cuda/$f\.o$" <<<"$ALL" || true)
    [ -n "$o" ] || die "no object target for ggml-rq/cuda/$f"
    OBJS+=("$o")
done
for f in $UPSTREAM; do
    o=$(grep "ggml-cuda\.dir/$f\.o$" <<<"$ALL" || true)
    [ -n "$o" ] || die "no object target for ggml-cuda/$f"
    OBJS+=("$o")
done
log "compiling ${#OBJS[@]} units with -j$JOBS:"
printf '    %s\n' "${OBJS[@]##*/}"
T1=$(date +%s)
ninja -C "$BUILD" -j "$JOBS" "${OBJS[@]}" || die "compilation failed"
log "compiled in $(( $(date +%s) - T1 )) s"

# ---- (d) the exact unit: no flush-to-zero, no fused multiply-add in its PTX
PTX=$BUILD/rq-iso.ptx
python3 - "$BUILD/compile_commands.json" "$PTX" <<'EOF' || die "PTX check failed"
import json, re, shlex, subprocess, sys
cc, ptx = sys.argv[1], sys.argv[2]
ent = next(e for e in json.load(open(cc)) if e["file"].endswith("ggml-rq/cuda/rq-iso.cu"))
args = shlex.split(ent["command"])
out, skip = [], 0
for a in args:
    if skip:
        skip -= 1
        continue
    if a in ("-o", "-MF", "-MT", "-x"):
        skip = 1
        continue
    if a in ("-c", "-MD") or a.startswith("--generate-code") or a.startswith("-gencode") or a.startswith("-arch") or a == "ccache":
        continue
    out.append(a)
src = ent["file"]
out = [a for a in out if a != src]
cmd = out + ["-x", "cu", "-ptx", "-arch=compute_90", "-o", ptx, src]
subprocess.run(cmd, check=True, cwd=ent["directory"])
text = open(ptx).read()
bad = sorted(set(re.findall(r"\b(?:[a-z]+\.[a-z0-9.]*ftz[a-z0-9.]*|fma\.rn\.f(?:32|64))\b", text)))
if bad:
    sys.exit(f"rq-iso.cu PTX has flush-to-zero or fused multiply-add instructions: {bad}")
print(f"[ci-compile] rq-iso.cu PTX: no .ftz, no fma ({len(text)} bytes)")
EOF

log "ok in $(( $(date +%s) - T0 )) s"
