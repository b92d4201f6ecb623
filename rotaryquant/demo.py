"""`make demo`: the main job on the embedded default models.

1. The converter: a Hugging Face folder rebuilt from the packaged SmolLM2-135M GGUF is converted with
   ``rq-convert --recipe rotaryquant-itq3`` (ITQ3_S where rows allow, per-role types elsewhere) and
   the result generates greedily in the patched llama.cpp.
2. The KV cache: Gemma3-270M (head size 256 = 2 x 128) runs with an F16 cache and with
   ``-ctk isoquant3_0 -ctv isoquant3_0`` (fused attention), printing both continuations and the KV
   sizes llama.cpp reports.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from rotaryquant import assets, paths
from rotaryquant.bindings.tools import binary

PROMPT = "The three most important inventions of the nineteenth century were"


def run_completion(model: str, prompt: str, n_predict: int, cache_type: str, threads: int) -> tuple[str, str, float]:
    """One greedy completion; returns (text, kv-cache log lines, seconds)."""
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


def convert_demo(threads: int, n_predict: int) -> None:
    from rotaryquant.converter.convert import Options, convert
    from rotaryquant.converter.rebuild import smollm2_hf_folder

    work = paths.cache_dir() / "demo"
    hf = work / "SmolLM2-135M-Instruct-hf"
    if not (hf / "config.json").exists():
        print(f"--- rebuilding a Hugging Face folder from the packaged GGUF -> {hf}")
        smollm2_hf_folder(assets.model_path("smollm2-135m"), hf)
    out = work / "SmolLM2-135M-rotaryquant-itq3.gguf"
    print(f"--- rq-convert {hf.name} {out.name} --recipe rotaryquant-itq3")
    t0 = time.time()
    res = convert(hf, out, Options(recipe="rotaryquant-itq3", progress=False))
    print(res.planner.summary())
    print(f"    {out.stat().st_size / 2**20:.1f} MiB in {time.time() - t0:.1f} s")
    text, _, dt = run_completion(str(out), PROMPT, n_predict, "f16", threads)
    print(f"=== SmolLM2-135M, rotaryquant-itq3 weights ({dt:.1f} s)\n{PROMPT}{text}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rotaryquant.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF for the KV-cache part (default: embedded Gemma3-270M)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--skip-convert", action="store_true", help="only the KV-cache part")
    ns = ap.parse_args(argv)
    try:
        if not ns.skip_convert:
            convert_demo(ns.threads, ns.n_predict)
        model = str(ns.model or assets.model_path(assets.ISO_MODEL))
        for cache in ("f16", "isoquant3_0"):
            text, kv, dt = run_completion(model, ns.prompt, ns.n_predict, cache, ns.threads)
            print(f"=== Gemma3-270M, KV cache {cache} ({dt:.1f} s)\n{kv}\n\n{ns.prompt}{text}\n")
    except Exception as e:  # one line, not a traceback: this is the user's first command
        print(f"rq-demo: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
