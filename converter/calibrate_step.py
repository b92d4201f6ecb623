"""The calibration step of :func:`rotaryquant.converter.convert.convert`: whether a conversion calibrates
(explicitly, or by default when it emits ITQ3_S), its text, the one llama.cpp pass that measures the statistics
(:mod:`calibration`, :mod:`kcenter`), and what a dry run announces. Loading saved statistics, and the temporary
Q8_0 conversion an HF source is measured on, are convert's (``_calibration``: it calls convert itself)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from rotaryquant.converter import calibration as C
from rotaryquant.converter import gguf_source, kcenter
from rotaryquant.converter import roles as R
from rotaryquant.converter.calibration import BLOCK, Stats
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.options import Options, Result
from rotaryquant.converter.qtypes import QT
from rotaryquant.converter.recipes import Planner
from rotaryquant.data import calibration_text

_HIGH_PRECISION = (QT.F32, QT.F16, QT.BF16, QT.Q8_0)


def itq3_wanted(planner: Planner) -> Callable[[str], bool]:
    """Weights the recipe (or a --tensor-type override) makes ITQ3_S, before the kurtosis rule: the
    ones worth second-order statistics."""
    def want(name: str) -> bool:
        role = R.classify(name, 2)
        t = planner.recipe.types.get(role)
        for ov in planner.overrides:
            if ov.regex.search(name):
                t = ov.qtype
                break
        return t == QT.ITQ3_S

    return want


def emits_itq3(planner: Planner) -> bool:
    """Whether the recipe or a --tensor-type override makes any weight ITQ3_S."""
    return QT.ITQ3_S in planner.recipe.types.values() or any(ov.qtype == QT.ITQ3_S for ov in planner.overrides)


def resolve_calibration(opts: Options, planner: Planner) -> tuple[Options, bool]:
    """ITQ3_S without second-order statistics loses to IQ3_S+imatrix (docs/results/weights-ftype-qwen.md),
    so a conversion that emits ITQ3_S calibrates on the packaged text unless told otherwise
    (auto_calibrate=False / --no-calibrate, --calibrate TEXT, --calibration-data). Returns the options to
    run with and whether calibration was turned on by this default."""
    if opts.calibrate is not None or opts.calibration_data or not opts.auto_calibrate or not emits_itq3(planner):
        return opts, False
    return replace(opts, calibrate=""), True


def _gram_estimate(planner: Planner, want: Callable[[str], bool]) -> tuple[int, int]:
    """(weights, bytes) of the Gram statistics a pass would accumulate (float64), from the plan's shapes;
    q/k/v and gate/up of a layer read one input, as the collector finds in the graph."""
    groups: dict[str, int] = {}
    n = 0
    for d in planner.decisions:
        n_in = d.shape[-1] if d.shape else 0   # numpy order: (rows, input width)
        if len(d.shape) != 2 or not want(d.name) or n_in % BLOCK:
            continue
        n += 1
        key = re.sub(r"\.(attn_[qkv]|ffn_(gate|up)(_shexp)?)\.weight$",
                     lambda m: ".attn_in" if m.group(1).startswith("attn") else ".ffn_in" + (m.group(3) or ""), d.name)
        groups[key] = n_in
    return n, sum(v * BLOCK * 8 for v in groups.values())


def calibration_input(opts: Options) -> tuple[bytes, str]:
    text = opts.calibrate
    if not text:
        text = calibration_text()
    path = Path(text).expanduser()
    if not path.is_file():
        raise ConvertError(f"calibration text {path} does not exist", fix="give a UTF-8 text file: --calibrate FILE")
    if opts.calibration_tokens < kcenter.MIN_TOKENS:
        raise ConvertError(f"{opts.calibration_tokens} calibration tokens are below the minimum {kcenter.MIN_TOKENS}",
                           fix=f"use {kcenter.MIN_TOKENS} or more")
    data = path.read_bytes()[: opts.calibration_tokens * 16]  # ~4 bytes per token: ample
    if len(data) < kcenter.MIN_TOKENS:                        # a token is at least one byte: fail early
        raise ConvertError(f"calibration text {path.name} is too short: {len(data)} bytes, at least "
                           f"{kcenter.MIN_TOKENS} tokens are needed", fix="pass a longer text with --calibrate")
    return data, path.name


def measure(model: Path, data: bytes, text_name: str, want: Callable[[str], bool], opts: Options, *,
            what: str, required: bool = True) -> Stats | None:
    r = gguf_source.open_gguf(model)   # one parse (a 150k-token vocabulary takes seconds)
    cands = [n for n, shp in C.gguf_shapes(model, r).items() if len(shp) == 2 and want(n) and shp[-1] % C.BLOCK == 0]
    try:
        kcenter.check_model(model, r)
        k_why = None
    except ConvertError as e:
        k_why = e.message
    if not cands and k_why is not None:
        if not required:
            return None
        raise ConvertError(f"nothing to calibrate in {what}: no weight of recipe {opts.recipe} is ITQ3_S with rows "
                           f"of a multiple of {C.BLOCK} values, and K centring does not apply ({k_why})",
                           fix="drop --calibrate, or use an ITQ3_S recipe (e.g. --recipe itq3)")
    stats = C.collect(model, data, text_name=text_name, want=want, k_stats=k_why is None,
                      n_tokens=opts.calibration_tokens, n_ctx=opts.calibration_ctx, threads=opts.threads,
                      progress=opts.progress, verbose=opts.verbose, reader=r)
    low = sorted({t.tensor_type.name for t in r.tensors if len(t.shape) >= 2 and t.tensor_type not in _HIGH_PRECISION
                  and R.classify(t.name, len(t.shape)) in R.PROMOTABLE})
    if low:
        stats.notes.append(f"calibration ran on {what} itself, whose linear weights are {'/'.join(low)} (a "
                           "higher-precision source measures better statistics)")
    if not cands:
        stats.notes.append(f"no ITQ3_S weight with rows of a multiple of {C.BLOCK} in recipe {opts.recipe}: "
                           "K centring only")
    if k_why is not None:
        stats.notes.append(f"K centring not measured: {k_why}")
    moe = [n for n, why in stats.skipped.items() if "MUL_MAT_ID" in why]
    if moe:
        stats.notes.append(f"{len(moe)} MoE expert tensor(s) (e.g. {moe[0]}) have no statistics: expert matmuls "
                           "(MUL_MAT_ID) are not collected, they are quantised without")
    missing = [n for n in cands if n not in stats.group_of]
    if missing:
        why = {stats.skipped[n] for n in missing if n in stats.skipped} or {"no matmul read them"}
        stats.notes.append(f"{len(missing)} ITQ3_S candidate weight(s) got no statistics ({'; '.join(sorted(why))}), "
                           f"e.g. {missing[0]}")
    return stats


def _check_calibration_used(result: Result, opts: Options) -> None:
    stats = result.calibration
    if stats is None or opts.dry_run:
        return
    if opts.calibration_data and result.kind == "hf":   # a GGUF source was checked before converting
        stats.check(stats.identity, {d.name: d.shape for d in result.planner.decisions}, what=result.source.name)
    n_itq3 = sum(1 for d in result.planner.decisions if d.qtype == QT.ITQ3_S)
    if n_itq3:
        result.notes.append(f"{len(result.calibrated)} of {n_itq3} ITQ3_S tensors quantised with their input "
                            "statistics (LDLQ)")


def _dry_run_calibration_note(kind: str, planner: Planner, opts: Options, result: Result) -> str:
    if opts.calibration_data:
        return f"dry run: would reuse the calibration statistics in {Path(opts.calibration_data).name}"
    n, nbytes = _gram_estimate(planner, itq3_wanted(planner))
    why = " (the default for recipes that emit ITQ3_S; --no-calibrate skips it)" if result.calibration_default else ""
    text = Path(opts.calibrate).name if opts.calibrate else "the packaged calibration text"
    on = "the source" if kind == "gguf" else "a temporary Q8_0 conversion of the source"
    return (f"dry run: would calibrate{why}: one llama.cpp pass over {opts.calibration_tokens} tokens of {text} on "
            f"{on}, Gram statistics for {n} ITQ3_S weight(s), about {nbytes / 1e6:.0f} MB during the pass, "
            "and K-centring statistics")
