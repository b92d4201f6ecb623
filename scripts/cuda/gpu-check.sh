#!/usr/bin/env bash
# The RotaryQuant CUDA check, prepared for one call of the device tool (an H200 machine: nvcc 13,
# cmake, ninja, 16 cores, python3 + numpy, no network, no models). Run from the repo root:
#
#   scripts/cuda/gpu-check.sh [all|build|test|bench]      (default all; results under $OUT)
#
# What only a GPU answers (the CUDA emulation, tests/cuda/test_emulation.py, runs the same sources' logic in CI):
# nvcc's code generation (fast math, contraction, register use), real warp scheduling and memory ordering,
# occupancy and timing; the counters here show the fused path ran on the device.
#
# Needs build/gpu-carry/llama-tree.tar.xz, made here by scripts/cuda/pack-tree.sh and carried
# (carry: ["build/gpu-carry"]); see docs/cuda.md. Stages, each logged and timed, each skipped when the
# time left (RQ_GPU_BUDGET seconds from the start, default 560) is too short for it:
#   build   unpack the tree, link our sources into it, configure (-DGGML_CUDA=ON, sm_90), build
#           ggml-cuda, test-backend-ops, llama-bench, llama-quantize and rq-counters
#   test    test-backend-ops -b CUDA0 against the CPU for FLASH_ATTN_EXT, SET_ROWS, CPY, GET_ROWS,
#           MUL_MAT, MUL_MAT_ID on isoquant3_0 / isoquant4_0 / isoquant3_64 / isoquant4_64 / itq3_s (the 64-wide
#           types' D = 64 cases on CUDA; their D = 128/256 and mixed-width cases report 'not supported');
#           a random-weight Qwen2-shaped model (head 128) quantised to Q4_K_M, ITQ3_S, IQ3_S, and one with
#           head size 64 (Q4_K_M); rq-counters on both (fused decode: 0 dequantised rows; on the head-64
#           model -ctk/-ctv isoquant3_0 resolve to isoquant3_64)
#   bench   llama-bench: KV f16 / q8_0 / q4_0 / isoquant3_0 / isoquant4_0 fused, isoquant3_0 unfused, and
#           isoquant3_0 / q4_0 with deferred prefill (LLAMA_KV_DEFERRED=1: its graph ops' first CUDA run) at
#           depth 0, 4K, 16K; the head-64 model with f16 / isoquant3_0 (-> isoquant3_64) / isoquant4_0;
#           weights ITQ3_S vs IQ3_S vs Q4_K_M
# Overrides: RQ_GPU_WORK (build/gpu-work), RQ_GPU_TARBALL, RQ_GPU_BUDGET, RQ_GPU_JOBS, RQ_GPU_ARCHS (90-real),
# RQ_GPU_TARGETS (ninja targets), RQ_GPU_DEPTHS (0,4096,16384), RQ_GPU_PP (512), RQ_GPU_TG (64),
# RQ_CUBLAS_DIR (include/ + lib/ of cuBLAS), NVCC.
# Outputs (8 files, what one call can bring back): summary.md, log.txt (the console), build.txt
# (configure, build, quantize), backend-ops.txt, counters.txt, bench-kv.md, bench-weights.md,
# bench-stderr.txt.
set -uo pipefail

STAGE=${1:-all}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/build/gpu-out}
WORK=${RQ_GPU_WORK:-$REPO/build/gpu-work}   # git-ignored: a warm machine keeps it between calls
TARBALL=${RQ_GPU_TARBALL:-$REPO/build/gpu-carry/llama-tree.tar.xz}
BUDGET=${RQ_GPU_BUDGET:-560}
JOBS=${RQ_GPU_JOBS:-$(nproc)}
ARCHS=${RQ_GPU_ARCHS:-90-real}
TARGETS=${RQ_GPU_TARGETS:-ggml-cuda test-backend-ops llama-bench llama-quantize llama}
DEPTHS=${RQ_GPU_DEPTHS:-0,4096,16384}
PP=${RQ_GPU_PP:-512}
TG=${RQ_GPU_TG:-64}
RC=0
T0=$(date +%s)

TREE=$WORK/tree
LLAMA=$TREE/vendor/llama.cpp
BUILD=$WORK/build
BIN=$BUILD/bin
MODELS=$WORK/models

mkdir -p "$OUT" "$WORK"
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.md
exec > >(tee -a "$LOG") 2>&1

elapsed() { echo $(( $(date +%s) - T0 )); }
left()    { echo $(( BUDGET - $(elapsed) )); }
log()     { echo "[gpu-check $(elapsed)s] $*"; }
note()    { echo "$*" >> "$SUMMARY"; }
# stage NAME SECONDS_NEEDED: false (and a note) when less time is left
enough()  { if [ "$(left)" -lt "$2" ]; then log "skip $1: $(left) s left, needs ~$2 s"; note "- $1: skipped (time budget)"; return 1; fi; }

[ -f "$SUMMARY" ] || printf '# RotaryQuant CUDA check\n\n' > "$SUMMARY"
note "- started $(date -u +%FT%TZ), stage '$STAGE', budget ${BUDGET} s"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/- GPU: /' >> "$SUMMARY"

# ---------------------------------------------------------------------------------------------
do_build() {
    if [ ! -e "$LLAMA/CMakeLists.txt" ]; then
        [ -f "$TARBALL" ] || { log "no $TARBALL: run scripts/cuda/pack-tree.sh here and carry build/gpu-carry"; note "- build: FAILED (no tarball)"; return 1; }
        log "unpack $TARBALL"
        mkdir -p "$TREE" && tar -C "$TREE" -xJf "$TARBALL" || { note "- build: FAILED (unpack)"; return 1; }
    fi
    ln -sfn "$REPO/ggml-patches/src" "$LLAMA/ggml/src/ggml-rq"
    ln -sfn "$REPO/ggml-patches/include/ggml-rq.h" "$LLAMA/ggml/include/ggml-rq.h"

    local nvcc=${NVCC:-}
    for c in "$nvcc" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
        if [ -n "$c" ] && [ -x "$c" ]; then nvcc=$c; break; fi
    done
    [ -n "$nvcc" ] || { note "- build: FAILED (no nvcc)"; return 1; }
    local croot; croot=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    local extra=()
    if [ -n "${RQ_CUBLAS_DIR:-}" ]; then
        # a folder with include/cublas_v2.h and lib/libcublas.so, lib/libcublasLt.so
        extra+=(-DCUDA_cublas_LIBRARY="$RQ_CUBLAS_DIR/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$RQ_CUBLAS_DIR/lib/libcublasLt.so"
                -DCMAKE_CUDA_FLAGS="-I$RQ_CUBLAS_DIR/include")
        export LD_LIBRARY_PATH="$RQ_CUBLAS_DIR/lib:${LD_LIBRARY_PATH:-}"
        log "cuBLAS from RQ_CUBLAS_DIR=$RQ_CUBLAS_DIR"
    elif ! ls "$croot"/lib64/libcublas.so* >/dev/null 2>&1 || [ ! -f "$croot/include/cublas_v2.h" ]; then
        # the image's Python has NVIDIA's cuBLAS wheel
        local nv; nv=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true)
        if [ -n "$nv" ] && [ -f "$nv/include/cublas_v2.h" ]; then
            mkdir -p "$WORK/cublas"
            for l in cublas cublasLt; do ln -sfn "$(ls "$nv"/lib/lib$l.so.* | head -1)" "$WORK/cublas/lib$l.so"; done
            extra+=(-DCUDA_cublas_LIBRARY="$WORK/cublas/libcublas.so" -DCUDA_cublasLt_LIBRARY="$WORK/cublas/libcublasLt.so"
                    -DCMAKE_CUDA_FLAGS="-I$nv/include")
            export LD_LIBRARY_PATH="$nv/lib:${LD_LIBRARY_PATH:-}"
            log "cuBLAS from the Python package: $nv"
        else
            log "cuBLAS not found (toolkit $croot, Python nvidia package)"; note "- build: FAILED (no cuBLAS)"; return 1
        fi
    fi

    log "configure ($ARCHS, -j$JOBS)"
    cmake -S "$REPO" -B "$BUILD" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release \
        -DRQ_LLAMA_DIR="$LLAMA" -DRQ_FUZZ=OFF -DGGML_CCACHE=OFF \
        -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        "${extra[@]}" > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; note "- build: FAILED (configure)"; return 1; }
    local t=$(date +%s)
    # shellcheck disable=SC2086
    if ! ninja -C "$BUILD" -j "$JOBS" $TARGETS >> "$OUT/build.txt" 2>&1; then
        grep -B2 -A12 -m5 "error" "$OUT/build.txt" | head -80
        note "- build: FAILED (see build.txt)"; return 1
    fi
    [ -e "$BIN/libllama.so" ] || { log "built $TARGETS"; return 0; }
    g++ -O2 -std=c++17 "$REPO/scripts/cuda/rq-counters.cpp" -I"$LLAMA/include" -I"$LLAMA/ggml/include" \
        -L"$BIN" -lllama -lggml -lggml-base -ldl -Wl,-rpath,"$BIN" -o "$BIN/rq-counters" || { note "- build: FAILED (rq-counters)"; return 1; }
    log "built in $(( $(date +%s) - t )) s"
    note "- build: ok in $(( $(date +%s) - t )) s ($ARCHS)"
}

# ---------------------------------------------------------------------------------------------
make_models() {
    mkdir -p "$MODELS"
    [ -f "$MODELS/f16.gguf" ] || PYTHONPATH="$LLAMA/gguf-py" python3 "$REPO/scripts/cuda/make-random-model.py" "$MODELS/f16.gguf" || return 1
    local q
    for q in Q4_K_M ITQ3_S IQ3_S; do
        [ -f "$MODELS/$q.gguf" ] || "$BIN/llama-quantize" "$MODELS/f16.gguf" "$MODELS/$q.gguf" "$q" "$JOBS" >> "$OUT/build.txt" 2>&1 \
            || { log "quantize $q failed"; return 1; }
    done
    # head size 64 (8 query / 2 KV heads of 64, like SmolLM2's head): the 64-wide IsoQuant types
    [ -f "$MODELS/h64-f16.gguf" ] || PYTHONPATH="$LLAMA/gguf-py" python3 "$REPO/scripts/cuda/make-random-model.py" \
        --n-embd 512 --n-head 8 --n-head-kv 2 --n-ff 1536 "$MODELS/h64-f16.gguf" || return 1
    [ -f "$MODELS/h64-Q4_K_M.gguf" ] || "$BIN/llama-quantize" "$MODELS/h64-f16.gguf" "$MODELS/h64-Q4_K_M.gguf" Q4_K_M "$JOBS" >> "$OUT/build.txt" 2>&1 \
        || { log "quantize h64 Q4_K_M failed"; return 1; }
}

do_test() {
    [ -x "$BIN/test-backend-ops" ] || { note "- test: no build"; return 1; }
    log "test-backend-ops -b CUDA0 (our types)"
    local t=$(date +%s)
    timeout 240 "$BIN/test-backend-ops" test -b CUDA0 -j 8 \
        -o FLASH_ATTN_EXT,SET_ROWS,CPY,GET_ROWS,MUL_MAT,MUL_MAT_ID -p 'isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s' \
        > "$OUT/backend-ops.txt" 2>&1
    local rc=$?
    local pass fail nsup
    pass=$(grep -c '): .*OK' "$OUT/backend-ops.txt" || true)
    fail=$(grep -c '): .*FAIL' "$OUT/backend-ops.txt" || true)
    nsup=$(grep -c '): not supported' "$OUT/backend-ops.txt" || true)
    log "test-backend-ops rc=$rc: $pass OK, $fail FAIL, $nsup not supported ($(( $(date +%s) - t )) s)"
    note "- test-backend-ops (CUDA0 vs CPU; FLASH_ATTN_EXT SET_ROWS CPY GET_ROWS MUL_MAT MUL_MAT_ID; isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s): rc=$rc, $pass OK, $fail FAIL, $nsup not supported"
    local p64 f64 n64 fa64
    p64=$(grep -E 'isoquant[34]_64' "$OUT/backend-ops.txt" | grep -c '): .*OK' || true)
    f64=$(grep -E 'isoquant[34]_64' "$OUT/backend-ops.txt" | grep -c '): .*FAIL' || true)
    n64=$(grep -E 'isoquant[34]_64' "$OUT/backend-ops.txt" | grep -c '): not supported' || true)
    fa64=$(grep -E 'FLASH_ATTN_EXT.*hsk=64,.*isoquant[34]_64|FLASH_ATTN_EXT.*isoquant[34]_64.*hsk=64,' "$OUT/backend-ops.txt" | grep -c '): .*OK' || true)
    note "  - of these with isoquant3_64/4_64: $p64 OK ($fa64 FLASH_ATTN_EXT at head size 64), $f64 FAIL, $n64 not supported (expected: D = 128/256 and mixed block widths)"
    if [ "$fa64" -eq 0 ]; then
        RC=1
        note "  - no FLASH_ATTN_EXT case with the 64-wide types passed at head size 64 on CUDA0"
    fi
    grep '): .*FAIL' "$OUT/backend-ops.txt" | head -20 | sed 's/^/  - /' >> "$SUMMARY"
    if [ "$pass" -eq 0 ] || [ "$fail" -ne 0 ] || [ $rc -ne 0 ]; then
        RC=1
        grep -q Skipping "$OUT/backend-ops.txt" && note "  - no CUDA0 backend: the build has no GPU or is not a CUDA build"
    fi

    enough "models" 60 || return 0
    log "random model + quantisations"
    make_models || { note "- models: FAILED"; return 1; }
    enough "counters" 30 || return 0
    log "rq-counters"
    timeout 120 "$BIN/rq-counters" "$MODELS/Q4_K_M.gguf" 512 32 > "$OUT/counters.txt" 2>&1
    local crc=$?
    [ $crc -eq 0 ] || RC=1
    grep -E '^(fused|unfused) |rq-counters:' "$OUT/counters.txt" | sed 's/^/  /'
    note "- counters (rq-counters, Q4_K_M random model, isoquant3_0 K/V): rc=$crc"
    grep -E '^(fused|unfused) |^rq-counters:' "$OUT/counters.txt" | sed 's/^/  - /' >> "$SUMMARY"

    enough "counters head 64" 30 || return 0
    log "rq-counters, head size 64 (isoquant3_0 -> isoquant3_64)"
    { echo; echo "### head size 64 (h64-Q4_K_M.gguf): isoquant3_0 resolves to isoquant3_64"; } >> "$OUT/counters.txt"
    timeout 120 "$BIN/rq-counters" "$MODELS/h64-Q4_K_M.gguf" 512 32 > "$WORK/counters64.txt" 2>&1
    crc=$?
    cat "$WORK/counters64.txt" >> "$OUT/counters.txt"
    [ $crc -eq 0 ] || RC=1
    grep -q 'using isoquant3_64' "$WORK/counters64.txt" || { RC=1; log "head 64: no 'using isoquant3_64' in the log"; }
    grep -E '^(fused|unfused) |rq-counters:' "$WORK/counters64.txt" | sed 's/^/  /'
    note "- counters, head size 64 (isoquant3_0 -> isoquant3_64): rc=$crc, resolved: $(grep -c 'using isoquant3_64' "$WORK/counters64.txt")"
    grep -E '^(fused|unfused) |^rq-counters:' "$WORK/counters64.txt" | sed 's/^/  - /' >> "$SUMMARY"
}

# ---------------------------------------------------------------------------------------------
bench() { # bench OUTFILE TITLE [env...] -- llama-bench args
    local out=$1 title=$2; shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    { echo; echo "### $title"; echo; } >> "$out"
    env "${envs[@]}" timeout 150 "$BIN/llama-bench" -ngl 99 -o md "$@" >> "$out" 2>> "$OUT/bench-stderr.txt" \
        || echo "(failed or timed out: rc=$?)" >> "$out"
}

do_bench() {
    [ -x "$BIN/llama-bench" ] && [ -f "$MODELS/Q4_K_M.gguf" ] || { enough "models" 60 && make_models || { note "- bench: no build/models"; return 1; }; }
    local kv=$OUT/bench-kv.md w=$OUT/bench-weights.md
    printf '# KV cache types (random Qwen2-shaped model, Q4_K_M weights, head 128, GQA 4, 8 layers)\n' > "$kv"
    local t
    for t in f16 q8_0 q4_0 isoquant3_0; do
        enough "bench-kv $t" 60 || break
        log "llama-bench KV $t"
        bench "$kv" "K/V $t" LLAMA_ISOQUANT_UNFUSED=0 LLAMA_KV_DEFERRED=0 -- -m "$MODELS/Q4_K_M.gguf" -fa 1 -ctk $t -ctv $t -d "$DEPTHS" -p "$PP" -n "$TG" -r 2
    done
    if enough "bench-kv isoquant3_0 unfused" 60; then
        log "llama-bench KV isoquant3_0 unfused"
        bench "$kv" "K/V isoquant3_0, unfused (LLAMA_ISOQUANT_UNFUSED=1)" LLAMA_ISOQUANT_UNFUSED=1 LLAMA_KV_DEFERRED=0 -- \
            -m "$MODELS/Q4_K_M.gguf" -fa 1 -ctk isoquant3_0 -ctv isoquant3_0 -d "$DEPTHS" -p "$PP" -n "$TG" -r 2
    fi
    # deferred prefill: prompt graphs dequantise the cache, undo attn_rot (q4_0) and patch F16 rows in (get_rows,
    # set_rows, cast, mul_mat): never run on a GPU before; pp is the number to compare with f16
    for t in isoquant3_0 q4_0; do
        enough "bench-kv $t deferred" 60 || break
        log "llama-bench KV $t deferred"
        bench "$kv" "K/V $t, deferred prefill (LLAMA_KV_DEFERRED=1)" LLAMA_ISOQUANT_UNFUSED=0 LLAMA_KV_DEFERRED=1 -- \
            -m "$MODELS/Q4_K_M.gguf" -fa 1 -ctk $t -ctv $t -d "$DEPTHS" -p "$PP" -n "$TG" -r 2
    done
    if enough "bench-kv isoquant4_0" 60; then
        log "llama-bench KV isoquant4_0"
        bench "$kv" "K/V isoquant4_0" LLAMA_ISOQUANT_UNFUSED=0 LLAMA_KV_DEFERRED=0 -- \
            -m "$MODELS/Q4_K_M.gguf" -fa 1 -ctk isoquant4_0 -ctv isoquant4_0 -d "$DEPTHS" -p "$PP" -n "$TG" -r 2
    fi
    # head size 64: the 64-wide IsoQuant types (isoquant3_0/4_0 resolve to isoquant3_64/4_64)
    for t in f16 isoquant3_0 isoquant4_0; do
        enough "bench-kv head 64 $t" 50 || break
        log "llama-bench KV head 64 $t"
        bench "$kv" "head size 64 model (h64-Q4_K_M), K/V $t" LLAMA_ISOQUANT_UNFUSED=0 LLAMA_KV_DEFERRED=0 -- \
            -m "$MODELS/h64-Q4_K_M.gguf" -fa 1 -ctk $t -ctv $t -d "$DEPTHS" -p "$PP" -n "$TG" -r 2
    done
    if enough "bench-weights" 60; then
        printf '# Weight types (random Qwen2-shaped model, F16 K/V)\n' > "$w"
        log "llama-bench weights"
        bench "$w" "ITQ3_S vs IQ3_S vs Q4_K_M" LLAMA_ISOQUANT_UNFUSED=0 -- \
            -m "$MODELS/ITQ3_S.gguf,$MODELS/IQ3_S.gguf,$MODELS/Q4_K_M.gguf" -fa 1 -p "$PP" -n $(( 2*TG )) -r 3
        ls -la "$MODELS" >> "$w"
    fi
    note "- bench: bench-kv.md, bench-weights.md"
}

case $STAGE in
    build) do_build ;;
    test)  do_test ;;
    bench) do_bench ;;
    all)   do_build && { do_test; do_bench; } ;;
    *) echo "usage: $0 [all|build|test|bench]" >&2; exit 2 ;;
esac
rc=$?
[ $RC -eq 0 ] || rc=1
note "- finished after $(elapsed) s (rc=$rc)"
log "done (rc=$rc); results in $OUT"
exit $rc
