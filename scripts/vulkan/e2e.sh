#!/usr/bin/env bash
# End to end on a Vulkan device: Gemma3-270M (K centring from rq-calibrate) with an isoquant3_0 K/V cache and every
# layer on the device, against the same on the CPU build, and the counters of its decode.
#
#   scripts/vulkan/e2e.sh [--report FILE]     (needs build/cpu and build/vulkan: make setup; scripts/ci/vulkan.sh)
#
# 1. rq-calibrate the model (CPU, 1024 tokens) into a temporary file.
# 2. llama-perplexity on E2E_CHUNKS chunks of E2E_CTX tokens of the evaluation text, -fa on. The CPU build with an
#    f16 cache writes the reference logits (--kl-divergence-base); scored against them: the CPU build and the
#    Vulkan build (-ngl 99) with an isoquant3_0 cache (what the cache costs on each), and the Vulkan build with an
#    f16 cache (the floor: two backends' arithmetic). Check: the cache costs the same on Vulkan as on the CPU,
#    KLD(Vulkan iso) <= E2E_MAX_COST x KLD(CPU iso). (Vulkan iso against CPU iso directly is no test: a 3-bit code
#    turns the backends' tiny differences in K into whole-level flips; measured 0.060 with the costs at 0.070.)
#    E2E_UNFUSED=1 adds the unfused path on Vulkan (dequantise to F16, then upstream's flash attention).
# 3. rq-counters (scripts/cuda/rq-counters.cpp, built against build/vulkan): fused decode on the device dequantises
#    nothing and is counted by the Vulkan backend; the unfused path dequantises.
# Exit status 1 when a check fails. Prints (and with --report writes) a small markdown table.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=$REPO/.venv/bin/python
CPU=$REPO/build/cpu/bin
VK=$REPO/build/vulkan/bin
CTX=${E2E_CTX:-256}
CHUNKS=${E2E_CHUNKS:-2}
MAX_COST=${E2E_MAX_COST:-1.25}
REPORT=
[ "${1:-}" = --report ] && REPORT=$2
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
log() { echo "[vulkan-e2e] $*"; }
die() { echo "[vulkan-e2e] error: $*" >&2; exit 1; }
for b in "$CPU/llama-perplexity" "$VK/llama-perplexity" "$PY"; do [ -x "$b" ] || die "missing $b (make setup; scripts/ci/vulkan.sh)"; done

W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
MODEL=$("$PY" -m rotaryquant.assets gemma3-270m | tail -1)
# the evaluation slice's first 100 kB: llama-perplexity tokenises its whole file (24 s for the whole slice)
head -c 100000 "$("$PY" -c "from rotaryquant import data; print(data.evaluation_text())")" > "$W/text.txt"
TEXT=$W/text.txt
t=$(date +%s)
"$PY" -m rotaryquant.converter.calibrate_cli "$MODEL" -o "$W/model.gguf" --tokens 1024 --ctx 1024 --no-progress > "$W/calib.log" 2>&1 \
    || { tail -20 "$W/calib.log"; die "rq-calibrate failed"; }
log "calibrated $(basename "$MODEL") in $(( $(date +%s) - t )) s"

ppl() {  # BIN KV OUT_NAME ARGS...
    local bin=$1 kv=$2 name=$3; shift 3
    "$bin/llama-perplexity" -m "$W/model.gguf" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" -fa on -t 2 \
        -ctk "$kv" -ctv "$kv" --kv-window 0 "$@" > "$W/$name.log" 2>&1 || { tail -30 "$W/$name.log"; die "llama-perplexity ($name) failed"; }
}
kld() { grep -E "Mean +KLD:" "$W/$1.log" | head -1 | awk '{print $(NF-2)}'; }
kse() { grep -E "Mean +KLD:" "$W/$1.log" | head -1 | awk '{print $NF}'; }
top() { grep -E "Same top p:" "$W/$1.log" | head -1 | awk '{print $(NF-3)}'; }

t=$(date +%s)
ppl "$CPU" f16         cpu-f16 --kl-divergence-base "$W/base-f16.dat"
ppl "$CPU" isoquant3_0 cpu-iso --kl-divergence-base "$W/base-f16.dat" --kl-divergence
ppl "$VK"  isoquant3_0 vk-iso  --kl-divergence-base "$W/base-f16.dat" --kl-divergence -ngl 99 -v
ppl "$VK"  f16         vk-f16  --kl-divergence-base "$W/base-f16.dat" --kl-divergence -ngl 99
[ "${E2E_UNFUSED:-0}" = 1 ] && ppl "$VK" isoquant3_0 vk-iso-unfused --kl-divergence-base "$W/base-f16.dat" --kl-divergence -ngl 99 --isoquant-unfused
log "perplexity runs in $(( $(date +%s) - t )) s"
# the Vulkan run (-v) put every layer and the KV cache on the device
off=$(grep -oE "offloaded [0-9]+/[0-9]+ layers to GPU" "$W/vk-iso.log" | tail -1 || true)
dev=$(grep -oE "using device Vulkan0 \([^)]*\)" "$W/vk-iso.log" | head -1 || true)
n=${off#offloaded }; n=${n%% *}
if [ -z "$off" ] || [ -z "$dev" ] || [ "${n%/*}" != "${n#*/}" ] || ! grep -q "Vulkan0 KV buffer" "$W/vk-iso.log"; then
    grep -iE "offload|vulkan" "$W/vk-iso.log" | head; die "the Vulkan run did not put every layer and the KV cache on Vulkan0"
fi
log "Vulkan runs: $dev, $off, KV cache on Vulkan0"

cost_cpu=$(kld cpu-iso); cost_vk=$(kld vk-iso)
table="| KV cache, backend (Gemma3-270M + rq-calibrate, ${CHUNKS}x${CTX} tokens, -fa on) | KLD vs CPU f16 | same top token |
| --- | ---: | ---: |
| f16, Vulkan (floor: two backends) | $(kld vk-f16) ± $(kse vk-f16) | $(top vk-f16) % |
| isoquant3_0, CPU | $cost_cpu ± $(kse cpu-iso) | $(top cpu-iso) % |
| isoquant3_0, Vulkan (fused) | $cost_vk ± $(kse vk-iso) | $(top vk-iso) % |"
if [ "${E2E_UNFUSED:-0}" = 1 ]; then
    table="$table
| isoquant3_0, Vulkan (unfused: F16 copies, upstream FA) | $(kld vk-iso-unfused) ± $(kse vk-iso-unfused) | $(top vk-iso-unfused) % |"
fi
echo "$table"
fails=0
awk -v a="$cost_vk" -v b="$cost_cpu" -v r="$MAX_COST" 'BEGIN { exit !(a <= r*b) }' \
    || { log "FAIL: the isoquant3_0 cache costs $cost_vk on Vulkan, > $MAX_COST x its CPU cost ($cost_cpu)"; fails=$((fails + 1)); }

# the counters of a prompt and 16 decode steps, fused and unfused
LL=$REPO/build/src/llama-cpp-python/vendor/llama.cpp
g++ -O2 -std=c++17 "$REPO/scripts/cuda/rq-counters.cpp" -I"$LL/include" -I"$LL/ggml/include" -L"$VK" \
    -lllama -lggml -lggml-base -ldl -Wl,-rpath,"$VK" -o "$W/rq-counters" || die "cannot build rq-counters"
if out=$("$W/rq-counters" "$W/model.gguf" 64 16 vulkan 2>"$W/counters.err"); then
    log "rq-counters: PASS"
else
    tail -20 "$W/counters.err"; log "FAIL: rq-counters"; fails=$((fails + 1))
fi
echo "$out" | grep -E "^(fused|unfused)"
if [ -n "$REPORT" ]; then
    { echo "$table"; echo; echo '```'; echo "$out" | grep -E "^(fused|unfused)"; echo '```'; } > "$REPORT"
    log "wrote $REPORT"
fi
[ $fails -eq 0 ] || die "$fails check(s) failed"
log "ok in $(( $(date +%s) - t )) s"
