#!/usr/bin/env bash
# The RotaryQuant Vulkan check for a real GPU, prepared for one call of the device tool (or any machine with a
# Vulkan driver). Runs the binaries of build/vulkan (carry it: its libraries are ~45 MiB; the GPU machine has
# no glslc), from the repo root:
#
#   scripts/vulkan/gpu-check.sh [device index, default 0]       (results under $OUT, default build/gpu-out)
#
#   vulkan   the loader and device (vulkaninfo --summary when present; ggml's device list)
#   test     test-rq-vulkan (bit-exactness against the C reference) and test-backend-ops -b Vulkan<N> for
#            FLASH_ATTN_EXT, SET_ROWS, GET_ROWS, CPY on our types
#   bench    a random-weight Qwen2-shaped model (head 128; scripts/cuda/make-random-model.py, needs numpy),
#            llama-bench -ngl 99 -fa 1: KV f16, q8_0, isoquant3_0 fused and unfused, at depth 0 and 4096;
#            speeds as ratios to f16 in the same run
# Lavapipe (Mesa's CPU Vulkan) runs this too, but its speed means nothing: the bench stage then only checks that
# the runs complete.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/build/gpu-out}
BIN=${RQ_VK_BIN:-$REPO/build/vulkan/bin}
DEV=${1:-0}
DEPTHS=${RQ_GPU_DEPTHS:-0,4096}
mkdir -p "$OUT"
SUMMARY=$OUT/summary-vulkan.md
exec > >(tee -a "$OUT/log-vulkan.txt") 2>&1
T0=$(date +%s)
log()  { echo "[vk-gpu-check $(( $(date +%s) - T0 ))s] $*"; }
note() { echo "$*" >> "$SUMMARY"; }
RC=0
printf '# RotaryQuant Vulkan check\n\n- started %s, device %s\n' "$(date -u +%FT%TZ)" "$DEV" > "$SUMMARY"

for b in test-backend-ops test-rq-vulkan llama-bench; do
    [ -x "$BIN/$b" ] || { log "missing $BIN/$b: build it with scripts/ci/vulkan.sh --quick (and llama-bench)"; note "- no $b"; exit 1; }
done
command -v vulkaninfo >/dev/null && vulkaninfo --summary 2>&1 | grep -E "deviceName|deviceType|apiVersion|driverName" | tee -a "$OUT/vulkaninfo.txt" | sed 's/^/- /' >> "$SUMMARY"
# CPU devices (lavapipe) are skipped unless listed
grep -q "PHYSICAL_DEVICE_TYPE_CPU" "$OUT/vulkaninfo.txt" 2>/dev/null && export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-$DEV}

log "test-rq-vulkan"
if "$BIN/test-rq-vulkan" "$DEV" > "$OUT/test-rq-vulkan.txt" 2>&1; then
    note "- test-rq-vulkan: $(grep '^test-rq-vulkan' "$OUT/test-rq-vulkan.txt")"
else
    RC=1; note "- test-rq-vulkan: FAILED"; grep FAIL "$OUT/test-rq-vulkan.txt" | head -10 | sed 's/^/  - /' >> "$SUMMARY"
fi
for op in FLASH_ATTN_EXT SET_ROWS GET_ROWS CPY; do
    timeout 300 "$BIN/test-backend-ops" test -b "Vulkan$DEV" -o "$op" \
        -p "isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s" > "$OUT/backend-ops-$op.txt" 2>&1
    rc=$?
    pass=$(grep -c '): .*OK' "$OUT/backend-ops-$op.txt" || true)
    fail=$(grep -c '): .*FAIL' "$OUT/backend-ops-$op.txt" || true)
    [ $rc -eq 0 ] && [ "$fail" -eq 0 ] || RC=1
    note "- test-backend-ops $op: rc=$rc, $pass OK, $fail FAIL"
    log "$op: rc=$rc, $pass OK, $fail FAIL"
done

MODEL=$OUT/random-qwen2.gguf
if [ ! -f "$MODEL" ]; then
    PYTHONPATH=$REPO/build/src/llama-cpp-python/vendor/llama.cpp/gguf-py python3 "$REPO/scripts/cuda/make-random-model.py" "$MODEL" \
        > "$OUT/model.txt" 2>&1 || { note "- bench: no model (numpy/gguf-py missing?)"; exit $RC; }
fi
log "llama-bench"
bench() {  # NAME ARGS...
    local name=$1; shift
    timeout 300 "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 512 -n 64 -d "$DEPTHS" -r 2 -o md "$@" \
        >> "$OUT/bench-vulkan.md" 2>> "$OUT/bench-vulkan-stderr.txt" || { RC=1; note "- bench $name: FAILED"; }
}
: > "$OUT/bench-vulkan.md"
bench kv -ctk f16,q8_0,isoquant3_0 -ctv f16,q8_0,isoquant3_0
LLAMA_ISOQUANT_UNFUSED=1 bench unfused -ctk isoquant3_0 -ctv isoquant3_0
note "- llama-bench: bench-vulkan.md (t/s; compare types within the run)"
log "done, rc=$RC"
exit $RC
