#!/usr/bin/env bash
# Build another llama.cpp (stock, the TurboQuant fork, ik_llama.cpp) for `rq-eval versus`, outside our tree.
#
#   scripts/peers/build.sh SRC NAME [TARGET...]
#
# SRC is the peer's source folder (a checkout of its public snapshot: the commit each result's JSON records under
# "builds"); NAME the folder under build/peers/ (bin folder: build/peers/NAME/bin, pass it as
# `rq-eval versus --build NAME=build/peers/NAME/bin`). CPU only, with the ggml CPU options our build uses
# (x86-64-v3: AVX, AVX2, FMA, F16C, BMI2; not native), Release, shared libraries, OpenMP, ccache where present.
# ik_llama.cpp's flash attention for every quantised cache type (GGML_IQK_FA_ALL_QUANTS) is switched on: its
# q4_0/iq4_nl caches need it. Default targets: the tools the measurements run; those a build lacks are skipped
# and named. Nothing here is the peer's code; nothing the peer ships is committed by us.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "[peers/build] error: $*" >&2; exit 1; }

case ${1:-} in -h|--help) usage; exit 0 ;; esac
[ $# -ge 2 ] || { usage >&2; die "needs SRC and NAME"; }
SRC=$(cd "$1" 2>/dev/null && pwd) || die "no source folder $1 (check out the peer's snapshot there first)"
NAME=$2; shift 2
[ -f "$SRC/CMakeLists.txt" ] && [ -d "$SRC/ggml" ] || die "$SRC is not a llama.cpp source tree (no CMakeLists.txt / ggml/)"
case $NAME in ''|*/*|.*) die "NAME must be a plain folder name, not '$NAME'" ;; esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=$REPO/build/peers/$NAME
mkdir -p "$OUT"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(llama-perplexity llama-bench llama-cli llama-completion llama-quantize llama-imatrix)

LAUNCHER=()
command -v ccache > /dev/null && LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)

echo "[peers/build] $SRC ($(git -C "$SRC" rev-parse --short=12 HEAD 2>/dev/null || echo 'no git')) -> $OUT"
cmake -S "$SRC" -B "$OUT" "${GEN[@]}" "${LAUNCHER[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DGGML_IQK_FA_ALL_QUANTS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -Wno-dev > "$OUT/configure.log" 2>&1 || { tail -20 "$OUT/configure.log" >&2; die "cmake configure failed (log: $OUT/configure.log)"; }

# the targets this tree has (a fork may lack llama-completion or name its CLI differently)
if [ ${#GEN[@]} -gt 0 ]; then
    HAVE=$(ninja -C "$OUT" -t targets all | sed -n 's/^\([^:]*\):.*/\1/p')
else
    HAVE=$(cmake --build "$OUT" --target help | sed -n 's/^\.\.\. \([^ ]*\).*/\1/p')
fi
BUILD=()
for t in "${TARGETS[@]}"; do
    if grep -qx "$t" <<< "$HAVE"; then BUILD+=("$t"); else echo "[peers/build] $NAME has no target $t: skipped"; fi
done
[ ${#BUILD[@]} -gt 0 ] || die "none of ${TARGETS[*]} is a target of $SRC"
cmake --build "$OUT" -j "${JOBS:-$(nproc)}" --target "${BUILD[@]}"
echo "[peers/build] built ${BUILD[*]} in $OUT/bin"
