"""The plan: every weights option x KV type at the context asked for, costed by llama.cpp and ranked."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rotaryquant import bindings, kvtypes
from rotaryquant.bindings.accounting import DryRun, NoAllocModel, dry_run
from rotaryquant.errors import PlanError
from rotaryquant.plan.commands import commands
from rotaryquant.plan.costing import Candidate, Plan, cpu_costs, gpu_costs, kv_bits, sort, transient_bytes
from rotaryquant.plan.errors import MiB, mib
from rotaryquant.plan.facts import (Header, calib_possible, head_widths, hf_header, read_header, resolve,
                                    write_skeleton)
from rotaryquant.plan.models import identify
from rotaryquant.plan.results import RESULTS, kv_quality, load_measurements
from rotaryquant.plan.weights import Weights, weights_options

# KV-cache specs the planner considers ("K/V"; "+calib": with the model's K calibration), best first
# by bits per value; head sizes that are neither 64 nor multiples of 128 rule out the IsoQuant ones (llama.cpp
# refuses them at context creation, and the dry run records that; for head size 64 it uses the 64-wide siblings)
KV_SPECS = ("f16", "q8_0", "q8_0/isoquant3_0", "q8_0/isoquant3_0+calib", "q4_0", "q4_0+calib", "isoquant4_0",
            "isoquant4_0+calib", "isoquant4_0/isoquant3_0+calib", "isoquant3_0", "isoquant3_0+calib")
KV_DEFAULT = ("f16", "q8_0", "q8_0/isoquant3_0+calib", "q4_0+calib", "isoquant4_0+calib",
              "isoquant4_0/isoquant3_0+calib", "isoquant3_0+calib")
# planned as llama.cpp runs them: on the CPU an IsoQuant V cache keeps its default recent window ("+w16"), the
# largest quality lever measured (docs/results/*-window-*); on a GPU there is none (the kernels lack it)

RECIPES = ("rotaryquant", "rotaryquant-itq3", "itq3-m", "itq3", "q8_0", "f16", "bf16")


class NoFit(PlanError):
    """No candidate fits the budget; ``plan`` holds them all (closest first)."""

    def __init__(self, plan: Plan, message: str, fix: str | None = None) -> None:
        self.plan = plan
        super().__init__(message, fix=fix)


def make_plan(model: str | Path, *, budget: int, ctx: int, parallel: int = 1, device: str = "cpu",
              deferred: bool = False, recipes: Sequence[str] | None = None, kv: Sequence[str] | None = None,
              results: Path = RESULTS, workdir: Path | None = None) -> Plan:
    """Every weights option x KV type at ``ctx`` tokens per slot, costed by llama.cpp and ranked."""
    t0 = time.perf_counter()
    if ctx < 16:
        raise PlanError(f"context {ctx} is too small", fix="give the tokens one request needs, e.g. --ctx 32768")
    if parallel < 1:
        raise PlanError(f"--parallel {parallel} must be at least 1")
    if device not in ("cpu", "cuda"):
        raise PlanError(f"unknown device {device!r}", fix="use cpu or cuda")
    kind, src = resolve(model)
    specs = list(kv or KV_DEFAULT)
    for s_ in specs:
        try:
            bindings.validate_kv_spec(s_)
        except ValueError as e:
            raise PlanError(f"KV spec {s_!r}: {e}", fix=f"use types such as {', '.join(KV_SPECS[:4])}") from None
    with contextlib.ExitStack() as stack:
        wd = Path(workdir) if workdir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rq-plan-")))
        h = read_header(src) if kind == "gguf" else hf_header(src, wd)
        km, same = identify(h)
        meas = load_measurements(results)
        n_ctx_train = int(h.get("context_length", 0) or 0)
        notes: list[str] = []
        if n_ctx_train and ctx > n_ctx_train:
            notes.append(f"--ctx {ctx} is beyond the model's training context {n_ctx_train}: quality there is unknown")
        if not kv and not h.calibrated:  # what runs with nothing done first: the runtime measures K itself
            specs.append("isoquant3_0" + kvtypes.SELF)
        why_no_calib = calib_possible(h)
        if why_no_calib:
            dropped = [s_ for s_ in specs if kvtypes.k_center(s_)]
            specs = [s_ for s_ in specs if not kvtypes.k_center(s_)]
            if dropped:
                notes.append(f"K calibration is not possible ({why_no_calib}): {', '.join(dropped)} left out")
        if not kv and device == "cpu":
            specs = [kvtypes.as_run(s_) for s_ in specs]
        options, wnotes = weights_options(h, list(RECIPES if recipes is None else recipes), source_kind=kind,
                                          meas=meas, model=km)
        notes += wnotes
        cands: list[Candidate] = []
        n_ctx = ctx * parallel
        for w in options:
            if w.skeleton is None:
                w.skeleton = wd / f"{w.name}.gguf"
                write_skeleton(h, w.types, w.skeleton)
            run = specs + (["f16"] if deferred and "f16" not in specs else [])
            dr = dry_run(w.skeleton, run, n_ctx=n_ctx, n_seq=parallel)
            f16 = dr.contexts.get("f16") if deferred else None
            for spec in specs:
                cost = dr.contexts[spec]
                transient = transient_bytes(f16, spec)
                c = Candidate(w.name, spec, ctx, n_ctx, bpw=w.bpw, kv_bits=kv_bits(spec, head_widths(h)),
                              weights_quality=w.quality,
                              kv_quality=kv_quality(spec, meas, km, same and w.name == "keep"))
                if cost.error:
                    c.error = cost.error
                elif device == "cpu":
                    c.bytes, c.peak, c.predicted = cpu_costs(h, w, dr, cost, transient=transient)
                    c.fits = c.peak <= budget
                else:
                    c.bytes, c.peak, c.host, c.experts_on_cpu, c.predicted = gpu_costs(
                        h, w, cost, budget=budget, transient=transient)
                    c.fits = c.peak <= budget
                cands.append(c)
        plan = Plan(str(src), kind, h.arch, h.n_params, km.label if km else None, same, budget, ctx, parallel,
                    device, deferred, sort(cands), notes=notes)
        if plan.winner is None:
            msg = _no_fit_message(plan, h, options)
            plan.seconds = time.perf_counter() - t0
            raise NoFit(plan, msg)
        commands(plan, h)
    plan.seconds = time.perf_counter() - t0
    return plan


def _no_fit_message(plan: Plan, h: Header, options: list[Weights]) -> str:
    ok = [c for c in plan.candidates if not c.error]
    if not ok:
        errs = "; ".join(dict.fromkeys(c.error for c in plan.candidates))
        return f"llama.cpp accepts none of the candidates for {Path(plan.model).name}: {errs}"
    small = min(ok, key=lambda c: c.peak)
    parts = ", ".join(f"{k} {mib(v):.0f}" for k, v in small.bytes.items() if v >= MiB / 2 and k != "load_peak")
    msg = (f"no candidate fits {mib(plan.budget):.0f} MiB at --ctx {plan.ctx}: the smallest, {small.label}, "
           f"needs {mib(small.peak):.0f} MiB ({parts} MiB)")
    if plan.device == "cpu":
        w = next(o for o in options if o.name == small.weights)
        best = _max_ctx(plan, h, w, small.kv)
        if best:
            msg += f"; with it, the largest context that fits is --ctx {best}"
        else:
            msg += "; even a tiny context does not fit: a smaller model or a larger budget is needed"
    return msg


def _max_ctx(plan: Plan, h: Header, w: Weights, spec: str) -> int:
    """The largest context per slot (a multiple of 256) at which ``w`` + ``spec`` fits the budget."""
    assert w.skeleton is not None
    with NoAllocModel(w.skeleton) as m:
        dr = DryRun(m.placement, {}, 0.0)

        def peak(ctx: int) -> int:
            cost = m.context(spec, ctx * plan.parallel, n_seq=plan.parallel)
            if cost.error:
                return 1 << 62
            f16 = m.context("f16", ctx * plan.parallel, n_seq=plan.parallel) if plan.deferred else None
            return cpu_costs(h, w, dr, cost, transient=transient_bytes(f16, spec))[1]

        lo, hi = 0, max(1, plan.ctx // 256)
        if peak(256) > plan.budget:
            return 0
        lo = 1
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if peak(mid * 256) <= plan.budget:
                lo = mid
            else:
                hi = mid
        return lo * 256
