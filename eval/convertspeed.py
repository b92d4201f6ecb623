"""Conversion speed and memory: rq-convert against the upstream two-step path, in the same run.

Per model and recipe:

* rq-convert: HF folder -> recipe GGUF in one streaming pass;
* upstream: ``convert_hf_to_gguf.py --outtype f16`` then ``llama-quantize`` to the matching ftype
  (rotaryquant -> Q4_K_M, itq3 and rotaryquant-itq3 -> ITQ3_S, q8_0 -> Q8_0);

throughput in M source weights per second of wall time and the peak RSS of each process (os.wait4).
SmolLM2 is rebuilt as an HF folder from its packaged GGUF; Gemma3 ships no HF folder and its rebuilt
tokenizer is unreliable, so Gemma3 is measured on the requantisation path (GGUF in: rq-convert vs
``llama-quantize --allow-requantize``). Every command runs in a child process, one at a time.

A child's ru_maxrss starts at its parent's RSS at fork (Linux keeps the high-water mark across exec),
so the measuring process must stay small: ``meta["parent_rss_mb"]`` records it, the floor of every
peak in the table.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rotaryquant import assets, gguf_io, paths
from rotaryquant.bindings.tools import binary
from rotaryquant.converter.hf import inspect_folder
from rotaryquant.errors import RQError

UPSTREAM_FTYPE = {"rotaryquant": "Q4_K_M", "itq3": "ITQ3_S", "rotaryquant-itq3": "ITQ3_S", "q8_0": "Q8_0",
                  "f16": None}
MODELS = ("smollm2", "gemma3")
INPUTS = ("hf", "gguf")


class ConvertSpeedError(RQError):
    """A measured command failed, or the plan names an unknown model or input."""


@dataclass
class Step:
    cmd: list[str]
    seconds: float
    peak_rss_mb: float
    rc: int


@dataclass
class Row:
    model: str
    source: str             # "hf" or "gguf"
    recipe: str
    path: str               # "rq-convert" or "upstream"
    weights: int
    seconds: float
    peak_rss_mb: float
    output_mb: float
    steps: list[Step] = field(default_factory=list)

    @property
    def mw_per_s(self) -> float:
        return self.weights / self.seconds / 1e6 if self.seconds > 0 else float("nan")


@dataclass
class Plan:
    """What one run measures; ``tiny()`` is the seconds-long smoke run."""
    models: list[str]
    recipes: list[str]
    inputs: list[str]
    layers: int | None = None    # keep only the first N layers of SmolLM2

    def __post_init__(self) -> None:
        for what, got, known in (("model", self.models, MODELS), ("input", self.inputs, INPUTS)):
            bad = [x for x in got if x not in known]
            if bad:
                raise ConvertSpeedError(f"unknown {what} {bad[0]!r}: choose from {', '.join(known)}")
        bad = [r for r in self.recipes if r not in UPSTREAM_FTYPE]
        if bad:
            raise ConvertSpeedError(f"no upstream counterpart for recipe {bad[0]!r}: choose from "
                                    f"{', '.join(UPSTREAM_FTYPE)}")
        if not self.recipes:
            raise ConvertSpeedError("no recipe to measure")
        if self.layers is not None and self.layers < 1:
            raise ConvertSpeedError(f"layers must be at least 1, got {self.layers}")

    def tiny(self) -> Plan:
        return Plan(["smollm2"], self.recipes[:1], ["hf"], 2)


def run_measured(cmd: list[str], *, env: dict | None = None, nice: int = 0) -> Step:
    """Run ``cmd``; wall seconds and the child's own peak RSS (ru_maxrss of exactly that process)."""
    t0 = time.perf_counter()
    cmd = ["nice", "-n", str(nice), *cmd] if nice else cmd  # nice execs cmd: wait4 still sees cmd itself
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise ConvertSpeedError(f"{' '.join(cmd)} failed ({p.returncode}): {err.decode(errors='replace')[-2000:]}")
    return Step(cmd, dt, ru.ru_maxrss / 1024.0, p.returncode)


def _hf_weights(folder: Path) -> int:
    return inspect_folder(folder, paths.llama_root()).n_weights


def _quantize_bin() -> Path:
    return binary("llama-quantize")


def _rq_convert_row(model: str, kind: str, src: Path, recipe: str, n: int, work: Path, nice: int) -> Row:
    """One measured rq-convert run (its own process); the output is deleted once its size is taken."""
    out = work / f"{model}-{recipe}.gguf"
    s = run_measured([sys.executable, "-m", "rotaryquant.converter.cli", str(src), str(out), "--recipe", recipe,
                      "--no-calibrate", "--no-progress", "--table", "none"], nice=nice)  # upstream's path has none
    size = out.stat().st_size / 1e6
    out.unlink()
    return Row(model, kind, recipe, "rq-convert", n, s.seconds, s.peak_rss_mb, size, [s])


def bench_hf(model: str, folder: Path, recipes: list[str], work: Path, nice: int = 0) -> list[Row]:
    py = sys.executable
    n = _hf_weights(folder)
    rows: list[Row] = []
    up_script = paths.llama_root() / "convert_hf_to_gguf.py"
    quant = _quantize_bin()
    f16 = work / f"{model}-upstream-f16.gguf"
    for recipe in recipes:
        rows.append(_rq_convert_row(model, "hf", folder, recipe, n, work, nice))
        s1 = run_measured([py, str(up_script), str(folder), "--outtype", "f16", "--outfile", str(f16)], nice=nice)
        steps = [s1]
        size = f16.stat().st_size
        ft = UPSTREAM_FTYPE.get(recipe)
        if ft is not None:
            q = work / f"{model}-upstream-{recipe}.gguf"
            steps.append(run_measured([str(quant), str(f16), str(q), ft], nice=nice))
            size = q.stat().st_size
            q.unlink()
        f16.unlink()
        rows.append(Row(model, "hf", recipe, "upstream", n, sum(x.seconds for x in steps),
                        max(x.peak_rss_mb for x in steps), size / 1e6, steps))
    return rows


def bench_gguf(model: str, gguf_path: Path, recipes: list[str], work: Path, nice: int = 0) -> list[Row]:
    n = int(sum(int(t.n_elements) for t in gguf_io.open_reader(gguf_path).tensors))
    quant = _quantize_bin()
    rows: list[Row] = []
    for recipe in recipes:
        rows.append(_rq_convert_row(model, "gguf", gguf_path, recipe, n, work, nice))
        ft = UPSTREAM_FTYPE.get(recipe) or "F16"
        q = work / f"{model}-upstream-{recipe}.gguf"
        s2 = run_measured([str(quant), "--allow-requantize", str(gguf_path), str(q), ft], nice=nice)
        rows.append(Row(model, "gguf", recipe, "upstream", n, s2.seconds, s2.peak_rss_mb, q.stat().st_size / 1e6, [s2]))
        q.unlink()
    return rows


def run(plan: Plan, work: Path, *, nice: int = 0) -> list[Row]:
    """Measure every (model, input, recipe) of ``plan``; scratch files go to ``work``."""
    rows: list[Row] = []
    for m in plan.models:
        if m == "smollm2":
            src = assets.model_path("smollm2-135m")
            name = "smollm2-135m" + (f"-{plan.layers}L" if plan.layers else "")
            if "hf" in plan.inputs:
                # built in a child: a fork inherits the parent's RSS high-water mark (Linux keeps
                # it across exec), so the parent must stay small for the peak-RSS numbers
                folder = work / "smollm2-hf"
                subprocess.run([sys.executable, "-c", ("import sys; from rotaryquant.converter.hf_folders import "
                                "smollm2_hf_folder as f; f(sys.argv[1], sys.argv[2], n_layers="
                                f"{plan.layers!r})"), str(src), str(folder)], check=True)
                rows += bench_hf(name, folder, plan.recipes, work, nice)
            if "gguf" in plan.inputs and not plan.layers:
                rows += bench_gguf("smollm2-135m-q4_1", src, plan.recipes, work, nice)
        elif m == "gemma3":
            rows += bench_gguf("gemma3-270m-q4_k_m", assets.model_path("gemma3-270m"), plan.recipes, work, nice)
    return rows


def meta(command: str) -> dict:
    return {"command": command, "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"),
            "parent_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}


def as_dict(rows: list[Row], meta: dict) -> dict:
    return {"meta": meta, "rows": [{**asdict(r), "mw_per_s": r.mw_per_s} for r in rows]}


def to_markdown(rows: list[Row], meta: dict) -> str:
    floor = (f" (the measuring process held {meta['parent_rss_mb']:.0f} MB: no peak below it is visible)"
             if "parent_rss_mb" in meta else "")
    lines = ["# Conversion benchmark: rq-convert vs convert_hf_to_gguf + llama-quantize", "",
             f"`{meta['command']}` on {meta['machine']} ({meta['cpus']} CPUs), {meta['date']}.",
             "Throughput = source weights / wall seconds of the whole path (both upstream steps for HF input);",
             f"peak RSS = the largest of the path's processes{floor}.",
             "Upstream: `convert_hf_to_gguf.py --outtype f16` then",
             "`llama-quantize` to rotaryquant->Q4_K_M, itq3/rotaryquant-itq3->ITQ3_S, q8_0->Q8_0 (GGUF input:",
             "`llama-quantize --allow-requantize` alone).", "",
             "| model | input | recipe | path | M weights | seconds | M weights/s | peak RSS MB | output MB |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.source} | {r.recipe} | {r.path} | {r.weights / 1e6:.1f} | {r.seconds:.1f} | "
                     f"{r.mw_per_s:.2f} | {r.peak_rss_mb:.0f} | {r.output_mb:.1f} |")
    return "\n".join(lines) + "\n"
