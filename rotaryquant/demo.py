"""`make demo`: the main job on the embedded default model.

Runs the patched llama.cpp (``llama-completion``) greedily on Gemma3-270M, whose 256-wide heads
IsoQuant supports, once with an F16 KV cache and once with ``-ctk isoquant3_0 -ctv isoquant3_0``
(fused attention), and prints both continuations with the KV-cache sizes llama.cpp reports.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from rotaryquant import assets
from rotaryquant.bindings.tools import binary

PROMPT = "The three most important inventions of the nineteenth century were"


def run_completion(model: str, prompt: str, n_predict: int, cache_type: str, threads: int) -> tuple[str, str, float]:
    """One greedy completion; returns (text, kv-cache log line, seconds)."""
    cmd = [str(binary("llama-completion")), "-m", model, "-p", prompt, "-n", str(n_predict),
           "--temp", "0", "--seed", "42", "-no-cnv", "-t", str(threads), "-c", "1024",
           "-fa", "on", "-ctk", cache_type, "-ctv", cache_type, "--no-warmup", "--no-display-prompt", "-lv", "4"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"llama-completion failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    kv = "\n".join(re.sub(r"^[\d.]+ I ", "", ln.strip()) for ln in proc.stderr.splitlines()
                   if re.search(r"llama_kv_cache: size|isoquant3_0 attention", ln))
    return proc.stdout.strip(), kv, dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rotaryquant.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded Gemma3-270M)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ns = ap.parse_args(argv)
    try:
        model = ns.model or str(assets.model_path(assets.ISO_MODEL))
        for cache in ("f16", "isoquant3_0"):
            text, kv, dt = run_completion(model, ns.prompt, ns.n_predict, cache, ns.threads)
            print(f"=== KV cache {cache} ({dt:.1f} s)\n{kv}\n\n{ns.prompt}{text}\n")
    except (assets.AssetError, FileNotFoundError, RuntimeError) as e:
        print(f"rq-demo: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
