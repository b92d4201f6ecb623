"""Measured quality: the KLD tables in docs/results, and what they say about one candidate."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rotaryquant import kvtypes, paths
from rotaryquant.plan.models import KnownModel, known_by_file

RESULTS = paths.REPO / "docs" / "results"


@dataclass(frozen=True)
class Measurement:
    what: str                # "kv" or "weights"
    spec: str                # KV spec ("q8_0/isoquant3_0+calib") or recipe ("q8_0")
    model: str               # known model id, or the file name when unknown
    label: str               # human name of the model and file measured
    ctx: int
    kld: float
    source: str              # results file


def _norm_spec(label: str) -> str:
    bare = kvtypes.with_window(label, 0)
    k, _, v = bare.replace("+calib", "").partition("/")
    spec = k if not v or v == k else f"{k}/{v}"
    return kvtypes.with_window(spec + ("+calib" if bare.endswith("+calib") else ""), kvtypes.window(label))


def _result_files(results: Path, pattern: str) -> Iterator[tuple[Path, dict]]:
    """(path, parsed JSON) of each readable results file matching pattern."""
    for p in sorted(Path(results).glob(pattern)):
        try:
            yield p, json.loads(p.read_text())
        except (OSError, ValueError):
            continue


# rq-eval weights rows made by rq-convert, calibrated as by default, without kurtosis promotion (as rq-plan
# plans a recipe): the recipe they measure
RECIPE_ROWS = {"ITQ3_S/rq+cal": "itq3", "ITQ3_S-M/rq+cal": "itq3-m"}


def load_measurements(results: Path = RESULTS) -> list[Measurement]:
    """Every KLD in docs/results that rq-plan can use: KV types (kv-quality*.json, fused, not deferred)
    and whole-model weight types (weights-*.json rows that requantise every tensor)."""
    out: list[Measurement] = []
    for p, d in _result_files(results, "kv-quality*.json"):
        km = known_by_file(d.get("model", ""))
        for r in d.get("rows", []):
            label = r.get("label", "")
            if r.get("unfused") or r.get("deferred") or " " in label or r.get("kld_mean") is None:
                continue
            out.append(Measurement("kv", _norm_spec(label), km.id if km else d["model"],
                                   f"{km.label if km else d['model']} ({d['model']})", int(r["ctx"]),
                                   float(r["kld_mean"]), p.name))
    for p, d in _result_files(results, "weights-*.json"):
        km = known_by_file(d.get("model", ""))
        for r in d.get("rows", []):
            label = r.get("label", "")
            # "Q8_0" rows requantise every tensor; "role=type" rows change one role only
            if "=" in label or r.get("kld_mean") is None:
                continue
            out.append(Measurement("weights", RECIPE_ROWS.get(label, label.lower()), km.id if km else d["model"],
                                   f"{km.label if km else d['model']} ({d['model']}, requantised from its F16)",
                                   int(d.get("ctx", 0)), float(r["kld_mean"]), p.name))
    return out


@dataclass
class Quality:
    """KLD of one component (weights or KV) of a candidate against the model's own F16."""

    kld: float | None = None           # on this model (None: unknown)
    exact: bool = False                # 0 by construction (the reference itself)
    where: str = ""                    # which measurement, or why exact
    elsewhere: list[dict] = field(default_factory=list)  # measurements on other models

    @property
    def key(self) -> float:
        """Ranking key: this model's number; else the worst measured elsewhere; else unknown (inf)."""
        if self.kld is not None:
            return self.kld
        vals = [e["kld"] for e in self.elsewhere]
        return max(vals) if vals else math.inf

    def text(self) -> str:
        if self.kld is not None:
            return "0 (exact)" if self.exact else f"{self.kld:.4f}"
        return "unknown"


def kv_quality(spec: str, meas: list[Measurement], model: KnownModel | None, same_weights: bool) -> Quality:
    if spec == "f16":
        return Quality(0.0, True, "f16 KV is the reference")
    rows = [m for m in meas if m.what == "kv" and m.spec == spec]
    mine = [m for m in rows if model is not None and m.model == model.id and same_weights]
    q = Quality()
    if mine:
        m = max(mine, key=lambda m: (m.ctx, m.source))
        q.kld, q.where = m.kld, f"{m.label}, ctx {m.ctx} ({m.source})"
    q.elsewhere = elsewhere([m for m in rows if m not in mine])
    return q


def elsewhere(rows: list[Measurement]) -> list[dict]:
    best: dict[str, Measurement] = {}
    for m in rows:  # per model, the longest context measured
        if m.model not in best or (m.ctx, m.source) > (best[m.model].ctx, best[m.model].source):
            best[m.model] = m
    return [{"model": m.label, "ctx": m.ctx, "kld": m.kld, "source": m.source} for m in best.values()]
