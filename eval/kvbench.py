"""KV-cache speed and size: llama-bench per cache type, fused vs unfused, at several depths, in one run.

Every number that is compared is a ratio inside the same run (these machines are noisy): decode
t/s of each type over f16 at the same depth, fused over unfused. KV bytes per token come from the
model's shapes and the types' block sizes (and are checked against the size llama.cpp logs).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rotaryquant import bindings, gguf_io, kvtypes, machine
from rotaryquant.bindings import tools
from rotaryquant.bindings.accounting import kv_bits_or_none
from rotaryquant.errors import RQError

# (label, cache type, unfused)
DEFAULT_CONFIGS: tuple[tuple[str, str, bool], ...] = (
    ("f16", "f16", False),
    ("q8_0", "q8_0", False),
    ("q4_0", "q4_0", False),
    ("isoquant3_0", "isoquant3_0", False),
    ("isoquant3_0-unfused", "isoquant3_0", True),
    ("q8_0/isoquant3_0", "q8_0/isoquant3_0", False),
)

# bytes per value of each cache type (type_size / block_size)
BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "isoquant3_0": 50 / 128, "isoquant4_0": 66 / 128,
                   "isoquant3_64": 26 / 64, "isoquant4_64": 34 / 64, "f32": 4.0}
# llama resolves the 128-wide IsoQuant types to these 64-wide siblings when the head size is 64
ISO_64 = {"isoquant3_0": "isoquant3_64", "isoquant4_0": "isoquant4_64"}


UNFUSED, DEFERRED = "-unfused", "-deferred"


def config(spec: str) -> tuple[str, str, bool]:
    """(label, cache type, unfused) for a --types entry: a cache spec, optionally with -unfused and/or
    -deferred (deferred prefill: prompts attend to an F16 transient until the sequence decodes)."""
    base = spec
    for suffix in (DEFERRED, UNFUSED, DEFERRED):
        base = base[: -len(suffix)] if base.endswith(suffix) else base
    return spec, bindings.validate_kv_spec(base), UNFUSED in spec


class BenchError(RQError):
    """A benchmark could not run; the message says why and what to change."""


@dataclass
class KVShape:
    n_layer: int
    n_embd_k_gqa: list[int]  # per layer
    n_embd_v_gqa: list[int]
    swa_layers: list[bool]
    sliding_window: int | None
    head_k: int = 0  # attention head sizes (0: unknown)
    head_v: int = 0

    def bytes_per_token(self, cache_type: str) -> float:
        """KV bytes one token adds to the cache (all layers, K and V), with the type llama uses for this head size."""
        tk, tv = kvtypes.split(cache_type)
        tk = ISO_64.get(tk, tk) if self.head_k == 64 else tk
        tv = ISO_64.get(tv, tv) if self.head_v == 64 else tv
        return sum(k * BYTES_PER_VALUE[tk] + v * BYTES_PER_VALUE[tv] for k, v in zip(self.n_embd_k_gqa, self.n_embd_v_gqa))


def kv_shape(model: Path) -> KVShape:
    """Per-layer K/V widths from the GGUF metadata (no llama.cpp context needed)."""
    r = gguf_io.open_reader(model)
    arch = r.get_field("general.architecture").contents()

    def get(key: str, default=None):
        f = r.get_field(f"{arch}.{key}")
        return default if f is None else f.contents()

    n_layer = int(get("block_count"))
    n_head = get("attention.head_count")
    n_head_kv = get("attention.head_count_kv", n_head)
    n_embd = int(get("embedding_length"))
    hk = get("attention.key_length")
    hv = get("attention.value_length")

    def per_layer(v) -> list[int]:
        return [int(x) for x in v] if isinstance(v, list) else [int(v)] * n_layer

    heads = per_layer(n_head)
    heads_kv = per_layer(n_head_kv)
    hk = int(hk) if hk is not None else n_embd // heads[0]
    hv = int(hv) if hv is not None else n_embd // heads[0]
    sw = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern")
    swa = [False] * n_layer
    if sw and pattern is not None:
        swa = [bool(x) for x in pattern] if isinstance(pattern, list) else [(i + 1) % int(pattern) != 0 for i in range(n_layer)]
    return KVShape(n_layer, [h * hk for h in heads_kv], [h * hv for h in heads_kv], swa, int(sw) if sw else None, hk, hv)


@dataclass
class BenchRow:
    label: str
    cache_type: str
    unfused: bool
    depth: int
    pp_tps: float | None = None
    tg_tps: float | None = None
    pp_std: float | None = None
    tg_std: float | None = None
    kv_bytes_per_token: float = 0.0
    extra: dict = field(default_factory=dict)


def run_llama_bench(model: Path, cache_type: str, *, unfused: bool, depths: list[int], n_prompt: int,
                    n_gen: int, reps: int, threads: int, timeout: float, deferred: bool = False) -> list[dict]:
    k, v = kvtypes.split(cache_type)
    cmd = [str(tools.binary("llama-bench")), "-m", str(model), "-fa", "1", "-ctk", k, "-ctv", v,
           "-p", str(n_prompt), "-n", str(n_gen), "-d", ",".join(str(d) for d in depths), "-r", str(reps),
           "-t", str(threads), "-o", "json", "--no-warmup"]
    env = dict(os.environ)
    env.pop("LLAMA_ISOQUANT_UNFUSED", None)
    env.pop("LLAMA_K_CENTER", None)
    env["LLAMA_KV_DEFERRED"] = "1" if deferred else "0"  # llama-bench has no flag for it
    if not kvtypes.k_center(cache_type):
        env["LLAMA_K_CENTER"] = "0"  # "+calib" runs use the model's calibration (when it has one)
    if unfused:
        env["LLAMA_ISOQUANT_UNFUSED"] = "1"
    env.pop("LLAMA_KV_LAYER_TYPES", None)
    if kvtypes.layer_types(cache_type):
        env["LLAMA_KV_LAYER_TYPES"] = kvtypes.layer_types(cache_type)  # llama-bench has no flag for it
    env["LLAMA_KV_WINDOW"] = str(kvtypes.window(cache_type))  # nor for this
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise BenchError(f"llama-bench failed for {cache_type} (exit {proc.returncode}): {proc.stderr[-1500:]}")
    return json.loads(proc.stdout)


def bench(model: Path, *, configs=DEFAULT_CONFIGS, depths=(0, 2048, 8192), n_prompt: int = 512, n_gen: int = 32,
          reps: int = 2, threads: int = 2, timeout: float = 3600, progress=print) -> dict:
    """reps rounds, each running every configuration once (interleaved, so that slow drifts of the
    machine - other tenants, clocks - spread over all configurations instead of biasing one)."""
    shape = kv_shape(model)
    samples: dict[tuple[str, int], dict[str, list[float]]] = {}
    t0 = time.time()
    for rnd in range(reps):
        for label, ctype, unfused in configs:
            progress(f"[rq-bench] round {rnd + 1}/{reps}: {label}, depths {list(depths)}")
            for rec in run_llama_bench(model, ctype, unfused=unfused, depths=list(depths), n_prompt=n_prompt,
                                       n_gen=n_gen, reps=1, threads=threads, timeout=timeout,
                                       deferred=DEFERRED in label):
                depth, kind = int(rec.get("n_depth", 0)), "pp" if int(rec["n_gen"]) == 0 else "tg"
                samples.setdefault((label, depth), {"pp": [], "tg": []})[kind].append(float(rec["avg_ts"]))
                # each result as it comes: a run at depth 32K takes most of an hour per configuration here
                progress(f"[rq-bench]   {label} at depth {depth}: {kind} {float(rec['avg_ts']):.2f} t/s")
    per_token = {c: shape.bytes_per_token(c) for _, c, _ in configs}
    mixed = [c for c in per_token if kvtypes.layer_types(c)]
    if mixed:  # per-layer types: llama.cpp's own accounting (bits per value x values per token)

        values = sum(shape.n_embd_k_gqa) + sum(shape.n_embd_v_gqa)
        for c, b in kv_bits_or_none(model, mixed, 4096, progress).items():
            per_token[c] = b / 8 * values
    rows: list[BenchRow] = []
    for label, ctype, unfused in configs:
        for depth in depths:
            s = samples.get((label, depth), {"pp": [], "tg": []})
            row = BenchRow(label, ctype, unfused, depth, kv_bytes_per_token=per_token[ctype])
            if s["pp"]:
                row.pp_tps, row.pp_std = statistics.fmean(s["pp"]), statistics.pstdev(s["pp"])
            if s["tg"]:
                row.tg_tps, row.tg_std = statistics.fmean(s["tg"]), statistics.pstdev(s["tg"])
            rows.append(row)
    # ratios inside this run
    for r in rows:
        base = next((b for b in rows if b.label == "f16" and b.depth == r.depth), None)
        if base and base.tg_tps and r.tg_tps:
            r.extra["tg_vs_f16"] = r.tg_tps / base.tg_tps
        if base and base.pp_tps and r.pp_tps:
            r.extra["pp_vs_f16"] = r.pp_tps / base.pp_tps
        if r.label == "isoquant3_0":
            unf = next((b for b in rows if b.label == "isoquant3_0-unfused" and b.depth == r.depth), None)
            if unf and unf.tg_tps and r.tg_tps:
                r.extra["tg_fused_over_unfused"] = r.tg_tps / unf.tg_tps
            if unf and unf.pp_tps and r.pp_tps:
                r.extra["pp_fused_over_unfused"] = r.pp_tps / unf.pp_tps
            q4 = next((b for b in rows if b.label == "q4_0" and b.depth == r.depth), None)
            if q4 and q4.tg_tps and r.tg_tps:
                r.extra["tg_vs_q4_0"] = r.tg_tps / q4.tg_tps
        if r.label.endswith(DEFERRED):
            plain = next((b for b in rows if b.label == r.label[: -len(DEFERRED)] and b.depth == r.depth), None)
            if plain and plain.tg_tps and r.tg_tps:
                r.extra["tg_deferred_over_plain"] = r.tg_tps / plain.tg_tps
            if plain and plain.pp_tps and r.pp_tps:
                r.extra["pp_deferred_over_plain"] = r.pp_tps / plain.pp_tps
        if kvtypes.suffix(r.label):
            plain = next((b for b in rows if b.label == r.label[: -len(kvtypes.suffix(r.label))] and b.depth == r.depth), None)
            if plain and plain.tg_tps and r.tg_tps:
                r.extra["tg_calib_over_plain"] = r.tg_tps / plain.tg_tps
            if plain and plain.pp_tps and r.pp_tps:
                r.extra["pp_calib_over_plain"] = r.pp_tps / plain.pp_tps
    return {
        "model": model.name,
        "kv_shape": asdict(shape),
        "machine": machine.describe(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {"n_prompt": n_prompt, "n_gen": n_gen, "reps": reps, "threads": threads, "depths": list(depths)},
        "seconds": round(time.time() - t0, 1),
        "rows": [asdict(r) for r in rows],
    }


def _ratio_table(rows: list[dict], title: str, cols: list[tuple[str, str]]) -> list[str]:
    """A table of the rows that carry the first column's ratio (empty when none do)."""
    sel = sorted((r for r in rows if cols[0][1] in r["extra"]), key=lambda r: (r["depth"], r["label"]))
    if not sel:
        return []
    out = ["", title, "", "| cache | depth | " + " | ".join(c for c, _ in cols) + " |",
           "|---|---:|" + "---:|" * len(cols)]
    for r in sel:
        vals = [r["extra"].get(k) for _, k in cols]
        out.append(f"| {r['label']} | {r['depth']} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in vals) + " |")
    return out


def to_markdown(res: dict) -> str:
    def f(x, nd=1):
        return "–" if x is None else f"{x:.{nd}f}"

    lines = [
        f"# KV-cache benchmark: {res['model']}",
        "",
        f"{res['date']}, {res['machine']['cpu']}, {res['settings']['threads']} threads; "
        f"llama-bench -fa 1, pp{res['settings']['n_prompt']} / tg{res['settings']['n_gen']} after a "
        f"prefilled depth, {res['settings']['reps']} interleaved rounds (mean); ratios are within this run.",
        "",
        "| cache | depth | KV bytes/token | pp t/s | tg t/s | tg / f16 | tg fused/unfused | tg / q4_0 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(res["rows"], key=lambda r: (r["depth"], r["label"])):
        e = r["extra"]
        lines.append(f"| {r['label']} | {r['depth']} | {r['kv_bytes_per_token']:.0f} | {f(r['pp_tps'])} | {f(r['tg_tps'])} "
                     f"| {f(e.get('tg_vs_f16'), 2)} | {f(e.get('tg_fused_over_unfused'), 2)} | {f(e.get('tg_vs_q4_0'), 2)} |")
    lines += _ratio_table(res["rows"], "K centring cost (a \"+calib\" row over the same cache without it, same run):",
                          [("tg calib/plain", "tg_calib_over_plain"), ("pp calib/plain", "pp_calib_over_plain")])
    lines += _ratio_table(res["rows"], "Deferred prefill (a \"-deferred\" row over the same cache without it, and over "
                          "f16, same run):", [("pp deferred/plain", "pp_deferred_over_plain"), ("pp deferred/f16", "pp_vs_f16"),
                                              ("tg deferred/plain", "tg_deferred_over_plain")])
    return "\n".join(lines) + "\n"
