#!/usr/bin/env bash
# The RotaryQuant Metal check, for one run on an Apple Silicon Mac (macOS, Xcode command-line tools with the Metal
# toolchain, python3 >= 3.10, cmake; the package index reachable for the first set-up). From the repo root:
#
#   scripts/metal/mac-check.sh [OUT_DIR]          (default build/metal-check; about 15-30 min on an M-series Mac)
#
# Our Metal kernels (ggml-patches/src/metal) have only run under tests/metal's emulation on Linux: this answers what
# the emulation cannot, in one command.
#   1. build    build/metal with -DGGML_METAL=ON -DGGML_RQ_METAL=ON (Apple's compiler sees kernels/rq.metal: a compile
#               error there is reported with the library's log and stops the check)
#   2. ops      test-backend-ops -b MTL0 against the CPU for GET_ROWS, SET_ROWS, FLASH_ATTN_EXT, MUL_MAT(_ID) on
#               isoquant3_0 / isoquant4_0 / isoquant3_64 / isoquant4_64 / itq3_s (counts of OK, FAIL, not supported)
#   3. counters scripts/cuda/rq-counters.cpp on Gemma3-270M (head 256) and Qwen2.5-Coder-1.5B (head 128): fused
#               decode dequantises nothing and counts Metal fused calls; --isoquant-unfused dequantises
#   4. bench    llama-bench, interleaved: f16, q8_0, isoquant3_0 fused and unfused at depth 0 and 4096 (tg64, pp512),
#               ratios to f16 in the same run
# Writes OUT_DIR/summary.md (paste it into the issue) and one log per step. Exit status 1 if a check failed.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
OUT=${1:-$REPO/build/metal-check}
mkdir -p "$OUT"
BIN=$REPO/build/metal/bin
TYPES='isoquant3_0|isoquant4_0|isoquant3_64|isoquant4_64|itq3_s'
SUM=$OUT/summary.md
T0=$(date +%s)
fails=0

log() { echo "[mac-check] $*" | tee -a "$OUT/log.txt"; }
die() { log "ERROR: $*"; exit 1; }

[ "$(uname -s)" = Darwin ] || die "run this on macOS (Apple Silicon); here: $(uname -s)"
[ "$(uname -m)" = arm64 ] || log "warning: $(uname -m), not arm64: results are not Apple Silicon's"
xcrun -sdk macosx metal --version >/dev/null 2>&1 || die "no Metal compiler (xcrun metal): install Xcode or its Metal toolchain"

{
    echo "# RotaryQuant Metal check"
    echo
    echo "- machine: $(sysctl -n machdep.cpu.brand_string 2>/dev/null), macOS $(sw_vers -productVersion 2>/dev/null)"
    echo "- metal compiler: $(xcrun -sdk macosx metal --version 2>&1 | head -1)"
    echo "- commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
    echo
} > "$SUM"

# 1. build
t=$(date +%s)
log "building build/metal (GGML_METAL=ON, GGML_RQ_METAL=ON)"
if python3 -m rotaryquant.build build --flavour metal --cmake-arg=-DGGML_METAL=ON --cmake-arg=-DGGML_RQ_METAL=ON \
        --target test-backend-ops --target llama-bench --target llama-cli --target llama \
        > "$OUT/build.txt" 2>&1; then
    log "built in $(( $(date +%s) - t )) s"
    echo "- build: ok ($(( $(date +%s) - t )) s)" >> "$SUM"
else
    tail -40 "$OUT/build.txt"
    echo "- build: FAILED (build.txt)" >> "$SUM"
    die "build failed (log: $OUT/build.txt)"
fi

# 2. test-backend-ops; the library compiles at the first op: its errors land in the log
echo >> "$SUM"; echo "| op | OK | FAIL | not supported |" >> "$SUM"; echo "|---|---:|---:|---:|" >> "$SUM"
for op in GET_ROWS SET_ROWS FLASH_ATTN_EXT MUL_MAT MUL_MAT_ID; do
    "$BIN/test-backend-ops" test -b MTL0 -o "$op" -p "$TYPES" > "$OUT/backend-ops-$op.txt" 2>&1
    rc=$?
    ok=$(grep -E "$TYPES" "$OUT/backend-ops-$op.txt" | grep -c "OK" || true)
    bad=$(grep -E "$TYPES" "$OUT/backend-ops-$op.txt" | grep -c "FAIL" || true)
    ns=$(grep -E "$TYPES" "$OUT/backend-ops-$op.txt" | grep -c "not supported" || true)
    echo "| $op | $ok | $bad | $ns |" >> "$SUM"
    log "test-backend-ops -b MTL0 $op: $ok OK, $bad FAIL, $ns not supported (rc $rc)"
    if [ "$rc" -ne 0 ] || [ "$bad" -ne 0 ] || [ "$ok" -eq 0 ]; then
        fails=$((fails + 1))
        grep -E "FAIL|error|Error" "$OUT/backend-ops-$op.txt" | head -20 | tee -a "$OUT/log.txt"
    fi
done

# 3. counters on real models (fetched once into the cache, as `make setup` does)
PY=$REPO/.venv/bin/python
LL=$REPO/build/src/llama-cpp-python/vendor/llama.cpp
c++ -O2 -std=c++17 "$REPO/scripts/cuda/rq-counters.cpp" -I"$LL/include" -I"$LL/ggml/include" -L"$BIN" \
    -lllama -lggml -lggml-base -Wl,-rpath,"$BIN" -o "$OUT/rq-counters" > "$OUT/counters-build.txt" 2>&1 \
    || { fails=$((fails + 1)); log "cannot build rq-counters (counters-build.txt)"; }
echo >> "$SUM"; echo '```' >> "$SUM"
for m in gemma3-270m qwen2.5-coder-1.5b; do
    path=$("$PY" -m rotaryquant.assets "$m" 2>>"$OUT/log.txt" | tail -1)
    [ -f "$path" ] || { fails=$((fails + 1)); log "no model $m"; continue; }
    if "$OUT/rq-counters" "$path" 256 32 metal > "$OUT/counters-$m.txt" 2> "$OUT/counters-$m.err"; then
        log "rq-counters $m: PASS"
    else
        fails=$((fails + 1)); log "rq-counters $m: FAIL"; tail -5 "$OUT/counters-$m.err" | tee -a "$OUT/log.txt"
    fi
    { echo "$m"; grep -E "^(fused|unfused)" "$OUT/counters-$m.txt"; } >> "$SUM"
done
echo '```' >> "$SUM"

# 4. llama-bench, every type in each round, ratios to f16 of the same round (the unfused path: LLAMA_ISOQUANT_UNFUSED=1)
QWEN=$("$PY" -m rotaryquant.assets qwen2.5-coder-1.5b 2>/dev/null | tail -1)
if [ -f "$QWEN" ]; then
    : > "$OUT/bench.jsonl"
    for r in 1 2; do
        for kv in f16 q8_0 isoquant3_0 isoquant3_0-unfused; do
            t=${kv%-unfused}; unf=0
            [ "$kv" != "$t" ] && unf=1
            LLAMA_ISOQUANT_UNFUSED=$unf "$BIN/llama-bench" -m "$QWEN" -fa 1 -ctk "$t" -ctv "$t" -d 0,4096 -p 512 -n 64 \
                -r 1 -o jsonl 2>>"$OUT/bench-stderr.txt" | sed "s/^{/{\"rq_round\": $r, \"rq_kv\": \"$kv\", /" >> "$OUT/bench.jsonl" \
                || { fails=$((fails + 1)); log "llama-bench $kv failed (bench-stderr.txt)"; }
        done
    done
    python3 - "$OUT/bench.jsonl" >> "$SUM" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
ts = {(r["rq_round"], r["rq_kv"], r["n_depth"], "pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
print("\nllama-bench, Qwen2.5-Coder-1.5B Q4_K_M, -fa 1, 2 interleaved rounds: t/s (ratio to f16 of the same round)\n")
print("| round | KV | depth | pp512 | tg64 |")
print("|---|---|---:|---:|---:|")
for (rd, kv, d, what) in sorted({k[:3] + ("pp",) for k in ts}):
    cells = []
    for w in ("pp", "tg"):
        v, f = ts.get((rd, kv, d, w)), ts.get((rd, "f16", d, w))
        cells.append(f"{v:.1f} ({v / f:.2f}x)" if v and f else "-")
    print(f"| {rd} | {kv} | {d} | {cells[0]} | {cells[1]} |")
PY
    log "bench: $OUT/bench.jsonl"
else
    log "no Qwen2.5-Coder-1.5B model: bench skipped"; fails=$((fails + 1))
fi

echo >> "$SUM"
echo "- checks failed: $fails; $(( $(date +%s) - T0 )) s in all" >> "$SUM"
log "summary: $SUM"
cat "$SUM"
[ $fails -eq 0 ] || exit 1
