"""rq-plan's output: the ranked table, the winner's command lines and advice as text, or the plan as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from rotaryquant.plan.costing import Plan
from rotaryquant.plan.errors import mib


def _m(n: int) -> str:
    return f"{mib(n):.0f}" if n else "-"


def render(plan: Plan, *, top: int = 12) -> str:
    """The ranked table, the winner's command lines and the advice, as text."""
    cpu = plan.device == "cpu"
    known = f"; quality tables measured on {plan.known}" + ("" if plan.same_weights else " (other weights)") \
        if plan.known else "; no quality measured on this model"
    lines = [f"rq-plan: {Path(plan.model).name} ({plan.arch}, {plan.n_params / 1e9:.2f} B parameters{known})",
             f"budget {mib(plan.budget):.0f} MiB {'RAM' if cpu else 'VRAM'}, --ctx {plan.ctx} x {plan.parallel} "
             f"slot(s), device {plan.device}{', deferred prefill' if plan.deferred else ''}; "
             f"{len(plan.candidates)} candidates costed by llama.cpp in {plan.seconds:.1f} s", ""]
    hdr = (["#", "weights", "KV K/V", "bpw", "KV bits", "weights", "KV", "compute", "other",
            "peak MiB" if cpu else "VRAM MiB", "fits", "KLD KV", "KLD weights", "evidence elsewhere (KV)"])
    rows = []
    shown = [c for c in plan.candidates if not c.error][:top]
    for c in shown:
        b = c.bytes
        wts = b.get("weights_mapped", 0) + b.get("weights_copied", 0) + b.get("weights_gpu", 0)
        other = b.get("kv_other", 0) + b.get("output", 0) + b.get("transient", 0) + b.get("base", 0)
        ev = ", ".join(f"{e['model'].split(' (')[0]} {e['kld']:.3f}" for e in c.kv_quality.elsewhere
                       if c.kv_quality.kld is None)
        rows.append([str(c.rank), c.weights, c.kv, f"{c.bpw:.2f}", f"{c.kv_bits:.2f}", _m(wts), _m(b.get("kv", 0)),
                     _m(b.get("compute", 0)), _m(other), f"{mib(c.peak):.0f}", "yes" if c.fits else "no",
                     c.kv_quality.text(), c.weights_quality.text(), ev or "-"])
    widths = [max(len(r[i]) for r in [hdr] + rows) for i in range(len(hdr))]
    right = {0, 3, 4, 5, 6, 7, 8, 9}
    fmt = lambda r: "  ".join(x.rjust(w) if i in right else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines += [fmt(hdr)] + [fmt(r) for r in rows]
    rest = len([c for c in plan.candidates if not c.error]) - len(shown)
    if rest > 0:
        lines.append(f"... {rest} more (--top N, or --json for all)")
    refused = [c for c in plan.candidates if c.error]
    if refused:
        lines.append("")
        for spec, err in dict.fromkeys((c.kv, c.error) for c in refused):
            lines.append(f"not possible: {spec}: {err}")
    w = plan.winner
    lines.append("")
    if w:
        lines.append(f"best that fits: {w.label} at {mib(w.peak):.0f} MiB predicted peak"
                     + (f" RSS ({mib(plan.budget - w.peak):.0f} MiB headroom)" if cpu else
                        f" VRAM, {mib(w.host):.0f} MiB host RAM"))
        if w.kv_quality.where:
            lines.append(f"  KV quality: KLD {w.kv_quality.text()} — {w.kv_quality.where}")
        if w.weights_quality.where:
            lines.append(f"  weights quality: {w.weights_quality.text()} — {w.weights_quality.where}")
        lines.append("  components from a formula, not llama.cpp: " + "; ".join(w.predicted))
        lines.append("")
        lines += [f"  {cmd}" for cmd in plan.commands]
        lines.append("")
        lines += [f"- {a}" for a in plan.advice]
    if plan.notes:
        lines += [""] + [f"note: {n}" for n in plan.notes]
    lines.append("")
    lines.append("KLD: mean KL divergence of the next-token distribution against the model's own F16 (weights) or "
                 "F16-KV run, from docs/results; 'unknown': not measured on this model (other models' numbers "
                 "rank it, they are not its quality). Sizes in MiB.")
    return "\n".join(lines)


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=1, default=str)
