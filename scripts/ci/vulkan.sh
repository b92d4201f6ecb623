#!/usr/bin/env bash
# CI job: the Vulkan backend on Mesa's lavapipe (a conformant Vulkan 1.3 device that runs on the CPU).
# Builds build/vulkan (-DGGML_VULKAN=ON; glslc, the Vulkan headers and lavapipe come from apt-get when
# missing, as root) and runs, on the Vulkan device against the CPU:
#   test-rq-vulkan    quantisers byte for byte and dequantisers bit for bit against the C reference, and the
#                     fused flash attention counted on the device
#   test-backend-ops  -b Vulkan0 for our types: FLASH_ATTN_EXT, SET_ROWS, GET_ROWS, CPY (MUL_MAT/MUL_MAT_ID
#                     on our types are not Vulkan kernels yet: the scheduler runs them on the CPU, and the
#                     job counts them as 'not supported')
#   end to end        Gemma3-270M (rq-calibrate'd), llama-perplexity -fa on -ctk/-ctv isoquant3_0 with every
#                     layer on the device (-ngl 99) vs the same on the CPU build: KLD on a short slice, next to
#                     the f16 cache's Vulkan-vs-CPU KLD (the noise floor of two backends); rq-counters: fused
#                     decode on the device dequantises nothing, the unfused path does
# Correctness only: lavapipe's speed says nothing of a GPU's, and the job reports none.
#
#   scripts/ci/vulkan.sh [--quick]      (needs `make setup` done; --quick skips the end-to-end run)
set -euo pipefail
CI_NAME=vulkan
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
QUICK=0
[ "${1:-}" = --quick ] && { QUICK=1; shift; }
ci_args "$@"
ci_check_tree
PY=$REPO/.venv/bin/python
[ -x "$PY" ] || die "no $PY; run 'make setup' first"
BIN=$REPO/build/vulkan/bin
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}   # ggml-vulkan skips CPU devices unless told

# lavapipe (Mesa's CPU Vulkan driver): the device these tests run on when the machine has no GPU
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    ci_apt_install "Mesa's Vulkan drivers (lavapipe)" mesa-vulkan-drivers vulkan-tools
fi

t=$(date +%s)
"$PY" -m rotaryquant.build build --vulkan -j "$JOBS" --target ggml-vulkan --target test-backend-ops \
    --target test-rq-vulkan --target llama-perplexity --target llama > "$REPO/build/vulkan-build.log" 2>&1 \
    || { tail -40 "$REPO/build/vulkan-build.log"; die "build failed (log: build/vulkan-build.log)"; }
log "built build/vulkan in $(( $(date +%s) - t )) s"
command -v vulkaninfo >/dev/null && vulkaninfo --summary 2>/dev/null | grep -E "deviceName|apiVersion|driverInfo" | sed 's/^/[vulkan]   /' || true

fails=0
if out=$("$BIN/test-rq-vulkan" 2>&1); then
    log "$(grep '^test-rq-vulkan' <<< "$out")"
else
    echo "$out" | tail -30; log "test-rq-vulkan: FAILED"; fails=$((fails + 1))
fi

total=0
for op in FLASH_ATTN_EXT SET_ROWS GET_ROWS CPY MUL_MAT MUL_MAT_ID; do
    out=$("$BIN/test-backend-ops" test -b Vulkan0 -o "$op" -p "$RQ_TYPES" 2>&1) && rc=0 || rc=$?
    ok=$(grep -cE "$RQ_TYPES" <<< "$(grep 'OK' <<< "$out")" || true)
    ns=$(grep -E "$RQ_TYPES" <<< "$out" | grep -c "not supported" || true)
    if [ $rc -ne 0 ] || grep -q "FAIL" <<< "$out"; then
        grep -E "FAIL" <<< "$out" | tail -20; log "test-backend-ops -b Vulkan0 $op: FAILED (rc $rc)"; fails=$((fails + 1))
    elif [ "$op" != MUL_MAT ] && [ "$op" != MUL_MAT_ID ] && [ "$ok" -eq 0 ]; then
        log "test-backend-ops -b Vulkan0 $op: no case of our types ran"; fails=$((fails + 1))
    else
        log "test-backend-ops -b Vulkan0 $op: $ok cases of our types passed, $ns not supported (CPU fallback)"
        total=$((total + ok))
    fi
done
log "test-backend-ops -b Vulkan0: $total cases of our types passed"

if [ $QUICK -eq 0 ]; then
    "$REPO/scripts/vulkan/e2e.sh" || fails=$((fails + 1))
fi
[ $fails -eq 0 ] || die "$fails check(s) failed"
log "all checks passed in $(( $(date +%s) - T0 )) s"
