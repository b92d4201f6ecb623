"""The calibration step of :func:`rotaryquant.converter.convert.convert`: whether a conversion calibrates
(explicitly, or by default when it emits ITQ3_S), the one llama.cpp pass that measures the statistics
(:mod:`calibration`, :mod:`kcenter`) or their reuse from a saved file, and what a dry run announces."""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rotaryquant.converter import gguf_source, kcenter
from rotaryquant.converter import roles as R
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.qtypes import QT
from rotaryquant.converter.recipes import Planner

if TYPE_CHECKING:
    from rotaryquant.converter.calibration import Stats
    from rotaryquant.converter.convert import Options, Result

log = logging.getLogger("rq-convert")

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
    from rotaryquant.converter.calibration import BLOCK

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


def _calibration_text(opts: Options) -> tuple[bytes, str]:
    text = opts.calibrate
    if not text:
        from rotaryquant.data import calibration_text

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


def _calibration(kind: str, src: Path, parent: Path, name: str, planner: Planner, opts: Options,
                 result: Result) -> Stats | None:
    """The statistics for this conversion: loaded (--calibration-data) or measured in one pass over the
    source (a GGUF) or a temporary Q8_0 conversion of it (an HF model), deleted afterwards."""
    from rotaryquant.converter import calibration as C

    want = itq3_wanted(planner)
    if opts.calibration_data:
        stats = C.Stats.load(opts.calibration_data)
        if kind == "gguf":
            r = gguf_source.open_gguf(src)
            stats.check(C.Identity.of_gguf(src, r), C.gguf_shapes(src, r), what=src.name)
        result.notes.append(f"calibration statistics from {Path(opts.calibration_data).name}: {stats.summary()}")
        return stats
    if opts.calibrate is None:
        return None
    data, text_name = _calibration_text(opts)
    tmp_q8 = None
    try:
        if kind == "gguf":
            model = src
        else:
            from rotaryquant.converter.convert import Options, _tmp, convert   # the recursion: HF -> Q8_0 first

            tmp_q8 = _tmp(parent, name, ".calib.tmp")
            log.info("converting %s to a temporary Q8_0 GGUF for calibration", src)
            convert(src, tmp_q8, Options(recipe="q8_0", tensor_backend=opts.tensor_backend, threads=opts.threads,
                                         progress=opts.progress, verbose=opts.verbose))
            model = tmp_q8
        stats = _measure(model, data, text_name, want, opts, what=src.name, required=not result.calibration_default)
        if stats is None:
            result.notes.append(f"not calibrated: no weight of {src.name} becomes ITQ3_S with rows of a multiple of "
                                "256 values, and K centring does not apply")
            return None
    finally:
        if tmp_q8 is not None:
            with contextlib.suppress(OSError):
                tmp_q8.unlink()
    if result.calibration_default:
        result.notes.append(f"calibrated by default ({opts.recipe} emits ITQ3_S, which without statistics loses to "
                            "IQ3_S+imatrix); --no-calibrate skips it, --save-calibration keeps the statistics")
    result.notes.append(stats.summary())
    result.notes.extend(stats.notes)
    if opts.save_calibration:
        result.notes.append(f"calibration statistics saved to {stats.save(opts.save_calibration)}")
    return stats


def _measure(model: Path, data: bytes, text_name: str, want: Callable[[str], bool], opts: Options, *,
             what: str, required: bool = True) -> Stats | None:
    from rotaryquant.converter import calibration as C

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
