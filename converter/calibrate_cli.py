"""``rq-calibrate``: the command line over :func:`rotaryquant.converter.kcenter.calibrate`."""

from __future__ import annotations

import argparse
import sys

from rotaryquant.converter import kcenter, kvalloc
from rotaryquant.errors import run_cli

EPILOG = """\
What it writes: rotaryquant.k_center.{version,layers,mean,scale} (float arrays, per layer x KV head x
channel) and provenance (.text, .text_sha256, .tokens, .rule, .tool). Metadata only: the tensors are
copied byte for byte and stock llama.cpp still loads the file (it ignores unknown keys).

What it changes: with a quantised K cache (q4_0, q8_0, isoquant3_0, ...) the patched llama.cpp caches
keys as (k - mu)/lam and multiplies queries by lam. softmax(q.k) is unchanged (q.mu is the same for
every key of a query), but the cache no longer spends its levels on each channel's constant part.
Turn it off for A/B runs with --no-k-center (llama.cpp tools), LLAMA_K_CENTER=0, or
llama_cpp.Llama(..., k_center=False).

With --kv-bits B it also chooses which layers' caches keep more bits (docs/usage.md, "Per-layer cache
types"): each layer's KLD cost at the narrower pair is measured on the calibration text, the least
sensitive layers are narrowed until the cache averages B bits/value, and the result is stored as
rotaryquant.kv_alloc.*. Use it with --kv-layer-types model (llama.cpp tools) or
Llama(..., kv_layer_types="model"). It runs the model 3 + n_layer times per chunk: with 2 chunks,
22 minutes for Gemma3-270M and 71 for Qwen2.5-1.5B on 2 cores that other jobs shared (quiet: less).

Refused: models whose attention is not shift-invariant (logit soft-capping: Gemma2, Grok; attention
sinks) and MLA models, where K doubles as V.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rq-calibrate",
        description="Measure per-channel K means and Q/K scales on calibration text and store them in a GGUF, "
                    "so that a quantised K cache keeps the model's quality.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="input .gguf")
    p.add_argument("-f", "--file", metavar="TEXT", help="calibration text (default: the packaged calibration "
                                                        "slice of the Shakespeare plays, which no eval scores)")
    p.add_argument("-o", "--output", metavar="OUT", help="output .gguf (default: rewrite MODEL in place, atomically)")
    p.add_argument("--tokens", type=int, default=kcenter.DEFAULT_TOKENS,
                   help=f"calibration tokens (default {kcenter.DEFAULT_TOKENS}, at least {kcenter.MIN_TOKENS})")
    p.add_argument("--ctx", type=int, default=2048, help="tokens per forward pass (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-bits", type=float, metavar="B", help="also choose per-layer K/V cache types for an "
                   "average of B bits/value (between the --kv-lo and --kv-hi pairs' own, e.g. 3.5)")
    p.add_argument("--kv-hi", default=kvalloc.HI, metavar="K/V", help=f"the wider pair (default {kvalloc.HI})")
    p.add_argument("--kv-lo", default=kvalloc.LO, metavar="K/V", help=f"the narrower pair (default {kvalloc.LO})")
    p.add_argument("--kv-chunks", type=int, default=kvalloc.DEFAULT_CHUNKS,
                   help=f"chunks of {kvalloc.N_CTX} tokens the sensitivities are measured on "
                        f"(default {kvalloc.DEFAULT_CHUNKS})")
    p.add_argument("--show", action="store_true", help="print per-layer statistics")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's own log while calibrating")
    return p


def _main(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)
    out, cal, alloc = kcenter.calibrate(args.model, args.output, text=args.file, n_tokens=args.tokens, n_ctx=args.ctx,
                                 threads=args.threads, progress=not args.no_progress, verbose=args.verbose,
                                 kv_bits=args.kv_bits, kv_hi=args.kv_hi, kv_lo=args.kv_lo, kv_chunks=args.kv_chunks)
    if args.show:
        for line in kcenter.summary(cal):
            print(line)
    print(f"wrote {out}: K centring for {len(cal.layers)} layers from {cal.tokens} tokens of {cal.text_name}")
    if alloc is not None:
        for line in alloc.summary():
            print(line)
        print(f"per-layer K/V types at {alloc.bits:.3f} bits/value: {alloc.spec}\n"
              f"use: llama-server -m {out} -fa on --kv-layer-types model")


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-calibrate", _main, argv, interrupted="interrupted; nothing written")


if __name__ == "__main__":
    sys.exit(main())
