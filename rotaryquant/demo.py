"""`make demo`: the main job on the embedded default models, each result beside its baseline.

1. Weights: a Hugging Face folder rebuilt from the packaged SmolLM2-135M GGUF is converted twice with
   ``rq-convert``, to F16 (the baseline) and with ``--recipe rotaryquant-itq3`` (ITQ3_S where rows
   allow, the paper's per-role types elsewhere); both generate greedily from the same prompt.
2. KV cache: Gemma3-270M (head size 256 = 2 x 128) with its K calibration (``rq-calibrate``, once)
   runs with an F16 cache and with the recommended compressed cache, ``-ctk isoquant4_0 -ctv
   isoquant3_0`` (K centring on, fused attention), then all-3-bit ``isoquant3_0`` K and V.

Each run prints its size (file or KV cache), decode speed and how many of its tokens match the
baseline's; the measured tables are in docs/results/REPORT.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import assets, paths
from rotaryquant.bindings.tools import binary

PROMPT = "The three most important inventions of the nineteenth century were"
REPORT = "docs/results/REPORT.md"
WIDTH = 96


@dataclass(frozen=True)
class Run:
    label: str
    text: str        # the continuation, with its own leading space
    size: str        # what the run keeps in memory, e.g. "KV 1.8 MiB"
    decode_tps: float


def _perf(stderr: str, what: str) -> float:
    """t/s of llama.cpp's perf line: "eval" (decode) or "prompt eval"."""
    m = re.search(rf"(?<!prompt ){what} time =.*?([\d.]+) tokens per second", stderr)
    return float(m.group(1)) if m else float("nan")


def kv_mib(stderr: str) -> float:
    """The KV cache llama.cpp allocated (both caches of an iSWA model), from its own log."""
    return sum(float(m) for m in re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", stderr))


def complete(model: Path, prompt: str, n_predict: int, threads: int, ctk: str = "f16", ctv: str = "f16",
             extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """One greedy completion with the patched llama-completion; returns (continuation, log)."""
    cmd = [str(binary("llama-completion")), "-m", str(model), "-p", prompt, "-n", str(n_predict),
           "--temp", "0", "--seed", "42", "-no-cnv", "-t", str(threads), "-c", "1024", "-fa", "on",
           "-ctk", ctk, "-ctv", ctv, "--no-warmup", "--no-display-prompt", "-lv", "4", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-completion failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout.rstrip(), proc.stderr


def same_words(a: str, b: str) -> tuple[int, int]:
    """(leading words of b equal to a's, words in b): how long a run follows its baseline."""
    wa, wb = a.split(), b.split()
    n = 0
    while n < min(len(wa), len(wb)) and wa[n] == wb[n]:
        n += 1
    return n, len(wb)


def show(prompt: str, runs: list[Run]) -> None:
    base = runs[0]
    for r in runs:
        if r is base:
            follows = "baseline"
        else:
            n, total = same_words(base.text, r.text)
            follows = "same text as the baseline" if n == total == len(base.text.split()) else \
                f"its first {n} of {total} words match the baseline"
        print(f"\n  {r.label}\n    {r.size}, decode {r.decode_tps:.1f} t/s, {follows}")
        for line in wrap(prompt + r.text):
            print(f"    | {line}")


def wrap(text: str) -> list[str]:
    import textwrap

    out: list[str] = []
    for para in text.splitlines() or [""]:
        out.extend(textwrap.wrap(para, WIDTH - 6) or [""])
    while out and not out[-1]:
        out.pop()
    return out


def weights_demo(prompt: str, threads: int, n_predict: int) -> None:
    from rotaryquant.converter.convert import Options, convert
    from rotaryquant.fixtures import smollm2_hf_folder

    print("\n[1/2] Weights: SmolLM2-135M-Instruct, F16 vs two rq-convert recipes")
    work = paths.cache_dir() / "demo"
    hf = work / "SmolLM2-135M-Instruct-hf"
    work.mkdir(parents=True, exist_ok=True)
    if not (hf / "config.json").exists():
        print(f"  rebuilding a Hugging Face folder from the packaged GGUF -> {hf}")
        smollm2_hf_folder(assets.model_path("smollm2-135m"), hf)
    recipes = (("f16", "F16 weights (baseline)"),
               ("rotaryquant", "--recipe rotaryquant: the paper's per-role mix, 4-bit attention and FFN"),
               ("rotaryquant-itq3", "--recipe rotaryquant-itq3: ITQ3_S (3-bit) where rows allow; experimental"))
    runs = []
    for recipe, label in recipes:
        out = work / f"SmolLM2-135M-{recipe}.gguf"
        t0 = time.time()
        res = convert(hf, out, Options(recipe=recipe, progress=False))
        n = res.n_weights or 1
        print(f"  rq-convert {hf.name} {out.name} --recipe {recipe}: {time.time() - t0:.1f} s")
        text, log = complete(out, prompt, n_predict, threads)
        size = out.stat().st_size
        runs.append(Run(label, text, f"{size / 2**20:.1f} MiB file, {size * 8 / n:.2f} bits/weight",
                        _perf(log, "eval")))
    show(prompt, runs)


def kv_demo(model: Path | None, prompt: str, threads: int, n_predict: int) -> None:
    from rotaryquant.converter import kcenter

    name = model.name if model else "Gemma3-270M"
    print(f"\n[2/2] KV cache: {name}, F16 vs compressed (1024-token context)")
    if model is None:
        src = assets.model_path(assets.ISO_MODEL)
        model = paths.cache_dir() / "demo" / (src.stem + ".kc.gguf")
        if not model.exists():
            print(f"  rq-calibrate {src.name} -o {model.name}  (K centring statistics, once; about a minute)")
            model.parent.mkdir(parents=True, exist_ok=True)
            kcenter.calibrate(src, model, progress=True)
    configs = (("f16", "f16", "F16 KV (baseline)"),
               ("isoquant4_0", "isoquant3_0", "isoquant4_0 K / isoquant3_0 V, K calibrated (recommended)"),
               ("isoquant3_0", "isoquant3_0", "isoquant3_0 K and V, K calibrated (3.125 bits/value)"))
    runs = []
    for ctk, ctv, label in configs:
        text, log = complete(model, prompt, n_predict, threads, ctk, ctv)
        runs.append(Run(label, text, f"KV {kv_mib(log):.2f} MiB", _perf(log, "eval")))
    show(prompt, runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rotaryquant.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF for the KV-cache part, calibrated with rq-calibrate (default: the embedded "
                         "Gemma3-270M, calibrated on first use)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--skip-convert", action="store_true", help="only the KV-cache part")
    ns = ap.parse_args(argv)
    print(f"RotaryQuant demo: greedy, {ns.n_predict} tokens, {ns.threads} threads; each result beside its baseline")
    try:
        if not ns.skip_convert:
            weights_demo(ns.prompt, ns.threads, ns.n_predict)
        kv_demo(ns.model, ns.prompt, ns.threads, ns.n_predict)
    except Exception as e:  # one line, not a traceback: this is the user's first command
        print(f"rq-demo: error: {e}", file=sys.stderr)
        return 1
    print(f"\nMeasured quality and speed per type (perplexity, KLD, needle-in-a-haystack, decode t/s by depth): "
          f"{REPORT}\nPick types for your model and memory: .venv/bin/rq-plan MODEL --budget 8G --ctx 32768")
    return 0


if __name__ == "__main__":
    sys.exit(main())
