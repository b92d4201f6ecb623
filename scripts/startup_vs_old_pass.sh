#!/bin/bash
# The first start's cost against what every start paid before K statistics were kept: per round, interleaved, an
# F16-cache start, a first start (empty statistics folder), the next start (the same folder), and one pass of 1024
# tokens with all logits (llama-perplexity -c 1024 --chunks 1, the old per-start recipe's size). rq-probe's JSON line
# per start; 2 threads.   usage: scripts/startup_vs_old_pass.sh MODEL [ROUNDS]   (after `make setup`)
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:?usage: $0 MODEL [ROUNDS]}
R=${2:-5}
T=${RQ_TEXT:-$HOME/.cache/rotaryquant/text/shakespeare.txt}
# rq-probe as rq-eval versus builds it for our library (compiled once per library content)
P=$(.venv/bin/python -c 'from rotaryquant.eval import builds; print(builds.probe(builds.ours()))')
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
seq 1000 1015 | tr '\n' ' ' > "$tmp/tok16.txt"
start() { "$P" decode -m "$M" -c 4096 -t 2 -fa on -ctk "$1" -ctv "$1" --tokens "$tmp/tok16.txt" --prefill 16 --steps 0 \
          "${@:2}" 2>/dev/null | grep first_token_s; }
for r in $(seq "$R"); do
  d=$(mktemp -d -p "$tmp")
  f16=$(start f16)
  first=$(start isoquant3_0 --k-stats "$d")
  next=$(start isoquant3_0 --k-stats "$d")
  old=$(build/cpu/bin/llama-perplexity -m "$M" -f "$T" -c 1024 --chunks 1 -t 2 2>&1 | grep -o "[0-9.]* seconds per pass")
  echo "round $r | f16 $f16 | first $first | next $next | old-pass $old"
done
