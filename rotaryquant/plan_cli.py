"""``rq-plan``: the command line over :func:`rotaryquant.plan.make_plan`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rotaryquant import plan as P
from rotaryquant import plan_verify
from rotaryquant.errors import UsageError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rq-plan",
        description="The best quality that fits a memory budget: every weights recipe x KV-cache type at the "
                    "context you need, costed by llama.cpp itself (a metadata-only load and dry contexts, no "
                    "weights read) and ranked by the quality measured in docs/results. Prints the ranked table "
                    "and, for the winner, the rq-convert/rq-calibrate and llama-server command lines.",
        epilog="Sizes: 16G = 16 GiB, 16GB = 16e9 bytes, 512M = 512 MiB. Peak = predicted peak resident memory "
               "of llama-server after a request that fills the context (CPU), or GPU memory (cuda). "
               "Check a prediction with rq-plan --verify MODEL ... (starts llama-server, reads VmHWM).")
    p.add_argument("model", nargs="*", help="GGUF file, Hugging Face folder, or repo id in the HF cache "
                                            "(--verify: several, or none for the models of this checkout)")
    p.add_argument("--budget", help="memory the server may use: RAM (cpu) or GPU memory (cuda), e.g. 16G")
    p.add_argument("--ctx", type=int, help="context one request needs, tokens (per slot)")
    p.add_argument("--parallel", type=int, default=1, help="llama-server slots; -c becomes ctx x N (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: all in RAM; cuda: layers on the GPU, routed experts moved to RAM (-ot) until the rest "
                        "fits (predicted only: no GPU here)")
    p.add_argument("--deferred", action="store_true",
                   help="plan for deferred prefill (--kv-deferred): add the F16 prompt transient of eq. 12")
    p.add_argument("--recipe", action="append", metavar="NAME",
                   help=f"weights recipes to consider (repeatable; default: {', '.join(P.RECIPES)}; a GGUF is "
                        "also considered as it is)")
    p.add_argument("--kv", help=f"comma-separated KV specs (default: {','.join(P.KV_DEFAULT)}); "
                                f"K/V pairs, +calib (the model's K calibration) and +wN (a recent window of N exact "
                                f"positions) allowed; on the CPU, default specs with an IsoQuant V get llama.cpp's "
                                f"default window, +w16; a spec given here runs as written")
    p.add_argument("--top", type=int, default=12, help="rows of the table (default 12)")
    p.add_argument("--json", action="store_true", help="the whole plan as JSON on stdout (for tools)")
    p.add_argument("--verify", action="store_true",
                   help="measure instead: start llama-server with the plan's command (the model as it is, the first "
                        "--kv type, --ctx), fill the context with one request, compare its VmHWM with the "
                        "prediction. Without MODEL: the models of this checkout, the synthetic MoE's -ot rules and "
                        "the paging experiment -> docs/results/plan-verify.json/.md (minutes)")
    p.add_argument("-o", "--out", type=Path, help="--verify: output stem (default docs/results/plan-verify, or "
                                                 "plan-verify-MODEL with MODEL)")
    return p


def _main(argv: list[str] | None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.verify:
        return plan_verify.main_verify(args)
    if len(args.model) != 1 or not args.budget or not args.ctx:
        ap.print_usage(sys.stderr)
        raise UsageError("give one MODEL, --budget and --ctx (e.g. rq-plan model.gguf --budget 16G --ctx 32768)")
    budget = P.parse_size(args.budget)
    kv = [s.strip() for s in args.kv.split(",") if s.strip()] if args.kv else None
    try:
        plan = P.make_plan(args.model[0], budget=budget, ctx=args.ctx, parallel=args.parallel, device=args.device,
                           deferred=args.deferred, recipes=args.recipe, kv=kv)
    except P.NoFit as e:  # the candidates, then run_cli's one-line error
        if args.json:
            print(P.to_json(e.plan))
        else:
            print(P.render(e.plan, top=args.top), file=sys.stderr)
        raise
    print(P.to_json(plan) if args.json else P.render(plan, top=args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-plan", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
