#!/usr/bin/env bash
# Pack the patched llama.cpp tree for the GPU machine, which cannot fetch the sdist itself.
#
#   scripts/cuda/pack-tree.sh [--tree DIR] [--out FILE]
#
# Writes build/gpu-carry/llama-tree.tar.xz (git-ignored through /build/): vendor/llama.cpp of the
# patched tree (patches 0001-0008 applied) without its git data, docs, models, media and examples
# (nothing the build needs), and without our linked sources (ggml/src/ggml-rq,
# ggml/include/ggml-rq.h): gpu-check.sh links those to the repo copy that travels with the call.
# Then run the device tool with carry ["build/gpu-carry"] (docs/cuda.md, "GPU check").
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TREE=$REPO/build/src/llama-cpp-python
OUTF=$REPO/build/gpu-carry/llama-tree.tar.xz
while [ $# -gt 0 ]; do
    case $1 in
        --tree) TREE=$(cd "$2" && pwd); shift 2 ;;
        --out)  OUTF=$2; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "pack-tree: unknown argument $1" >&2; exit 2 ;;
    esac
done

LLAMA=$TREE/vendor/llama.cpp
grep -q "ggml-rq/cuda/rq-cuda.cmake" "$LLAMA/ggml/src/ggml-cuda/CMakeLists.txt" 2>/dev/null \
    || { echo "pack-tree: $TREE does not carry patch 0008 (the CUDA hooks)" >&2; exit 1; }
if [ -d "$TREE/.git" ] && [ -n "$(git -C "$TREE" status --porcelain --untracked-files=no)" ]; then
    echo "pack-tree: note: $TREE has uncommitted edits; they are packed as they are" >&2
fi

mkdir -p "$(dirname "$OUTF")"
tar -C "$TREE" -cf - \
    --exclude='vendor/llama.cpp/.git' --exclude='vendor/llama.cpp/docs' --exclude='vendor/llama.cpp/models' \
    --exclude='vendor/llama.cpp/media' --exclude='vendor/llama.cpp/examples' --exclude='vendor/llama.cpp/.github' \
    --exclude='vendor/llama.cpp/ggml/src/ggml-rq' --exclude='vendor/llama.cpp/ggml/include/ggml-rq.h' \
    --exclude='__pycache__' \
    vendor/llama.cpp | xz -T0 -6 > "$OUTF.tmp"
mv "$OUTF.tmp" "$OUTF"
echo "pack-tree: $OUTF ($(du -h "$OUTF" | cut -f1))"
