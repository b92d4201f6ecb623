"""``rq-convert``: the command line over :func:`rotaryquant.converter.convert.convert`."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from rotaryquant.converter import kcenter
from rotaryquant.converter import roles as R
from rotaryquant.converter.convert import Options, convert
from rotaryquant.converter.recipes import ACT_KURTOSIS_THRESHOLD, KURTOSIS_THRESHOLD, RECIPES
from rotaryquant.errors import RQError, UsageError, run_cli

_ROLE_ORDER = (R.ATTENTION, R.FFN_DENSE, R.FFN_ROUTED, R.FFN_SHARED, R.OTHER, R.TOKEN_EMBD, R.OUTPUT)


def recipes_help() -> str:
    lines = ["recipes (type per tensor role; norms, 1-D tensors and MoE routers stay f32):"]
    for r in RECIPES.values():
        t = r.table()
        lines.append(f"  {r.name:<17} {r.summary}")
        lines.append("      " + ", ".join(f"{role}={t[role]}" for role in _ROLE_ORDER))
        if r.rules:
            lines.append("      then: " + "; ".join(f"{k} -> {v}" for k, v in r.rule_table().items())
                         + ("; no kurtosis promotion" if not r.promote else ""))
    lines += [
        "",
        "roles: attention = blk.N.attn_*; ffn_dense = blk.N.ffn_{gate,up,down}; ffn_routed = *_exps (MoE",
        "experts); ffn_shared = *_shexp (shared expert); other = any other 2-D weight.",
        "",
        "kurtosis rule: a tensor whose weight excess kurtosis exceeds --kurtosis-threshold (default",
        f"{KURTOSIS_THRESHOLD:g}; with --imatrix, the activation kurtosis and --act-kurtosis-threshold, default",
        f"{ACT_KURTOSIS_THRESHOLD:g}) goes one step up: q2_K/itq3_s->q4_K, q4_K/q5_*/q4_*->q6_K, q6_K->q8_0.",
        "The paper's reference: kappa = 10.10 (shared expert) vs 0.41 (routed experts). Not for the",
        "float recipes. --tensor-type overrides win over both; rows that do not fit a type's block fall",
        "back as llama-quantize does (q4_K->q5_0, q2_K->q4_0, itq3_s->iq4_nl, q6_K->q8_0).",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rq-convert",
        description="Hugging Face model folder, repo id or GGUF -> GGUF with ITQ3_S and RotaryQuant per-role "
                    "mixed precision, streamed tensor by tensor.",
        epilog=recipes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="HF folder (config.json, *.safetensors, tokenizer), repo id (org/name, from "
                                  "the HF cache), or a .gguf file to requantise")
    p.add_argument("output", nargs="?", help="output .gguf (written to a temp file in its folder, renamed at the end)")
    p.add_argument("--recipe", default="rotaryquant", choices=list(RECIPES), help="type per role (see below)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help="override matching tensors (llama-quantize syntax, e.g. attn_v=q8_0); first match wins")
    p.add_argument("--imatrix", metavar="FILE", help="importance matrix GGUF from llama-imatrix: weights the "
                                                      "quantisers and gives activation kurtosis")
    p.add_argument("--kurtosis-threshold", type=float, default=KURTOSIS_THRESHOLD, metavar="K",
                   help=f"promote tensors whose weight excess kurtosis exceeds K (default {KURTOSIS_THRESHOLD:g})")
    p.add_argument("--act-kurtosis-threshold", type=float, default=ACT_KURTOSIS_THRESHOLD, metavar="K",
                   help=f"the same for activation kurtosis when --imatrix is given (default {ACT_KURTOSIS_THRESHOLD:g})")
    p.add_argument("--no-promote", action="store_true", help="measure kurtosis but never promote")
    p.add_argument("--calibrate", nargs="?", const="", default=None, metavar="TEXT",
                   help="one llama.cpp pass over TEXT (default: the packaged calibration text) on the source "
                        "(a GGUF) or a temporary Q8_0 conversion of it (HF), measuring (1) per 256-column block "
                        "the Gram matrix of every ITQ3_S weight's inputs, which the ITQ3_S quantiser then "
                        "minimises the output error with (LDLQ), and (2) K-cache centring statistics, stored in "
                        "the output as rq-calibrate does. On by default (packaged text) when the recipe or an "
                        "override emits ITQ3_S; --dry-run says so. See docs/converter.md")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not calibrate ITQ3_S recipes (faster; ITQ3_S then loses to IQ3_S+imatrix)")
    p.add_argument("--calibration-tokens", type=int, default=kcenter.DEFAULT_TOKENS, metavar="N",
                   help=f"tokens of TEXT to use (default {kcenter.DEFAULT_TOKENS}, at least {kcenter.MIN_TOKENS})")
    p.add_argument("--save-calibration", metavar="FILE.npz",
                   help="with --calibrate: also save the measured statistics, for --calibration-data")
    p.add_argument("--calibration-data", metavar="FILE.npz",
                   help="reuse statistics saved with --save-calibration (refused when the model's vocabulary "
                        "or tensors differ from the one they were measured on)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (types and why) without writing")
    p.add_argument("--table", choices=("changes", "full", "none"), default="changes",
                   help="per-tensor table: only promoted/overridden/fallback tensors (default), all, or none")
    p.add_argument("--threads", type=int, default=None, help="quantisation threads (default: all cores)")
    p.add_argument("--tensor-backend", choices=("auto", "numpy", "torch"), default="auto",
                   help="how upstream's per-architecture tensor code runs: numpy stand-in (no torch needed) "
                        "or torch; auto = numpy for verified architectures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="upstream converter logs, tracebacks on errors")
    return p


def _main(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="rq-convert: %(levelname)s: %(message)s")

    if not args.dry_run and not args.output:
        raise UsageError("no output file given (rq-convert SOURCE OUT.gguf, or --dry-run)")
    if args.calibration_data and args.calibrate is not None:
        raise UsageError("--calibrate measures statistics, --calibration-data reuses them; give one")
    if args.no_calibrate and (args.calibrate is not None or args.calibration_data):
        raise UsageError("--no-calibrate contradicts --calibrate / --calibration-data; give one")
    opts = Options(recipe=args.recipe, tensor_types=args.tensor_type, imatrix=args.imatrix,
                   kurtosis_threshold=args.kurtosis_threshold, act_kurtosis_threshold=args.act_kurtosis_threshold,
                   promote=not args.no_promote, measure=True if args.table == "full" or args.dry_run else None,
                   dry_run=args.dry_run, threads=args.threads, tensor_backend=args.tensor_backend,
                   progress=not args.no_progress, verbose=args.verbose, calibrate=args.calibrate,
                   auto_calibrate=not args.no_calibrate,
                   calibration_data=args.calibration_data, save_calibration=args.save_calibration,
                   calibration_tokens=args.calibration_tokens)
    try:
        res = convert(args.source, args.output, opts)
    except RQError as e:  # run_cli prints it; --verbose shows what it came from first
        if args.verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        raise
    pl = res.planner
    if args.table != "none":
        rows = pl.table(full=args.table == "full" or args.dry_run)
        if rows.count("\n"):
            print(rows)
    print(pl.summary())
    for n in res.notes:
        print(f"note: {n}")
    if res.output is not None:
        print(f"wrote {res.output} ({res.output_bytes / 1e6:.1f} MB, {res.file_type}) in {res.seconds:.1f} s, "
              f"{res.weights_per_second / 1e6:.1f} M weights/s" + (f", {res.backend} backend" if res.backend else ""))
    else:
        print(f"dry run: nothing written ({res.seconds:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-convert", _main, argv, interrupted="interrupted; no output written")


if __name__ == "__main__":
    sys.exit(main())
