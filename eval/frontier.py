"""The KV-cache frontier of one model: bits per value against KLD (rq-eval ppl) and needles found (rq-eval niah),
from every result file whose rows record ``bits_per_value``. One point per cache spec; specs measured only one
way still appear (the other value is missing)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Point:
    spec: str
    bits: float
    kld: float | None = None        # mean KLD at the largest context of its file
    kld_ctx: int | None = None
    found: int | None = None        # needles found / asked, summed over depths and seeds
    asked: int | None = None
    niah_ctx: int | None = None


def collect(results: Path, model: str, niah_ctx: int = 8192) -> list[Point]:
    pts: dict[str, Point] = {}
    for f in sorted(results.glob("kv-quality*.json")):
        d = json.loads(f.read_text())
        if d.get("model") != model:
            continue
        rows = [r for r in d["rows"] if r.get("bits_per_value") is not None and not r.get("deferred")
                and not r.get("unfused")]
        for r in rows:
            p = pts.setdefault(r["label"], Point(r["label"], r["bits_per_value"]))
            if r["label"] != "f16" and (p.kld_ctx is None or r["ctx"] >= p.kld_ctx):
                p.kld, p.kld_ctx = r["kld_mean"], r["ctx"]
    for f in sorted(results.glob("niah*.json")):
        d = json.loads(f.read_text())
        if d.get("model") != model:
            continue
        for r in d["rows"]:
            if r.get("bits_per_value") is None or r["ctx"] != niah_ctx:
                continue
            p = pts.setdefault(r["cache"], Point(r["cache"], r["bits_per_value"]))
            if p.niah_ctx is None:  # the first file that has this spec at this context
                p.found, p.asked, p.niah_ctx = 0, 0, niah_ctx
            p.found += r["found"]
            p.asked += r["asked"]
    return sorted(pts.values(), key=lambda p: p.bits)


def to_markdown(points: list[Point], model: str) -> str:
    lines = [f"## KV-cache frontier: {model}", "",
             "| cache | bits/value | mean KLD (ctx) | needles (ctx) |", "|---|---:|---:|---:|"]
    for p in points:
        kld = "–" if p.kld is None else f"{p.kld:.4f} ({p.kld_ctx})"
        nia = "–" if p.found is None else f"{p.found}/{p.asked} ({p.niah_ctx})"
        lines.append(f"| {p.spec} | {p.bits:.3f} | {kld} | {nia} |")
    return "\n".join(lines) + "\n"


def draw(ax, points: list[Point], model: str) -> None:
    """KLD (log) against bits/value; each point labelled with its needles (and its deferred-prefill run's)."""
    by = {p.spec: p for p in points}
    shown = [p for p in points if p.kld is not None]
    ax.scatter([p.bits for p in shown], [p.kld for p in shown],
               c=[(p.found / p.asked) if p.asked else 0.5 for p in shown], cmap="RdYlGn", vmin=0, vmax=1,
               edgecolors="black", zorder=3)
    for i, p in enumerate(shown):
        tag = p.spec.replace("+self", "").replace("+calib", "*").replace("isoquant", "iso")
        if p.asked:
            tag += f"  {p.found}/{p.asked}"
        d = by.get(p.spec + " deferred")
        if d is not None and d.asked:
            tag += f", deferred {d.found}/{d.asked}"
        ax.annotate(tag, (p.bits, p.kld), fontsize=6, xytext=(5, 4 if i % 2 else -9), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per K/V value")
    ax.set_ylabel("mean KLD vs f16 KV")
    ax.set_title(f"KV frontier ({model}); colour, label: needles found")
