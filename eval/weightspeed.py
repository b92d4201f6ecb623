"""Weight-type speed that can be cited: llama-bench prompt (pp) and decode (tg) t/s per GGUF, interleaved.

Round r runs every file once, one repetition each (A, B, C, A, B, C, ...), so that a slow drift of a
shared machine (other tenants, clocks, page cache) hits every file alike. Per file: the median and the
spread (min-max, and the interquartile range) of the rounds' t/s. Ratios to the first file (the
baseline) are taken inside each round, then summarised by their median: the number to compare.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rotaryquant import gguf_io, machine
from rotaryquant.bindings import tools
from rotaryquant.errors import RQError
from rotaryquant.gguf_io import read_header


class WeightSpeedError(RQError):
    """The benchmark cannot run or a run failed; the message says which file and why."""


@dataclass
class FileInfo:
    name: str
    size_mib: float
    n_params: int
    bpw: float  # bits per weight over all tensors (tensor bytes * 8 / elements)
    types: dict[str, int]  # tensor type -> parameters stored in it


def file_info(path: Path, foreign: bool = False) -> FileInfo:
    """What a GGUF holds: its tensor types by parameter count and its bits per weight. ``foreign``: a file of another
    build (its type ids may mean other types here): types by id, bytes from the data offsets."""
    if foreign:
        h = read_header(path, foreign=True)
        by_id: dict[str, int] = {}
        for t in h.tensors:
            by_id[f"type {t.type}"] = by_id.get(f"type {t.type}", 0) + t.n
        return FileInfo(path.name, round(path.stat().st_size / 2**20, 1), h.n_params, 8 * h.data_bytes / h.n_params,
                        dict(sorted(by_id.items(), key=lambda kv: -kv[1])))
    r = gguf_io.open_reader(path)
    types: dict[str, int] = {}
    n_bytes = 0
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_elements)
        n_bytes += int(t.n_bytes)
    n = sum(types.values())
    return FileInfo(path.name, round(path.stat().st_size / 2**20, 1), n, 8 * n_bytes / n if n else 0.0,
                    dict(sorted(types.items(), key=lambda kv: -kv[1])))


def run_llama_bench(bench: Path, model: Path, *, n_prompt: int, n_gen: int, threads: int,
                    timeout: float) -> dict[str, float]:
    """One llama-bench repetition of one file: {"pp": t/s, "tg": t/s} (a test with 0 tokens is left out)."""
    with tempfile.TemporaryDirectory(prefix="rq-bench-") as tmp:
        path = model
        if "," in str(model):  # llama-bench splits -m on commas (a mixture's --custom-q in the name): a link without
            path = Path(tmp) / model.name.replace(",", "+")
            path.symlink_to(model.resolve())
        cmd = [str(bench), "-m", str(path), "-p", str(n_prompt), "-n", str(n_gen), "-r", "1", "-t", str(threads),
               "-o", "json"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise WeightSpeedError(f"llama-bench on {model.name} ran past {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise WeightSpeedError(f"llama-bench failed on {model.name} (exit {proc.returncode}): {proc.stderr[-1500:]}")
    try:
        recs = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise WeightSpeedError(f"llama-bench on {model.name} printed no JSON: {proc.stdout[-300:]!r}") from None
    out: dict[str, float] = {}
    for rec in recs:
        out["tg" if int(rec["n_gen"]) > 0 else "pp"] = float(rec["avg_ts"])
    want = {k for k, n in (("pp", n_prompt), ("tg", n_gen)) if n > 0}
    if set(out) != want:
        raise WeightSpeedError(f"llama-bench on {model.name} reported {sorted(out)}, expected {sorted(want)}")
    return out


def summary(xs: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the quartiles (inclusive method: the data's own range) of one sample."""
    xs = sorted(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], 0, xs[0])
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3, "n": len(xs)}


Runner = Callable[[Path], dict[str, float]]


def measure(files: Sequence[Path], *, rounds: int = 5, n_prompt: int = 512, n_gen: int = 128, threads: int = 2,
            bench: Path | None = None, timeout: float = 3600, runner: Runner | None = None,
            progress: Callable[[str], None] = print, foreign: bool = False) -> dict:
    """rounds x (every file once, in the order given); the first file is the baseline of the ratios.
    Every file is checked before the first run: a missing one stops it with nothing measured."""
    files = [Path(f) for f in files]
    if not files:
        raise WeightSpeedError("no GGUF file to measure")
    if rounds < 1:
        raise WeightSpeedError(f"rounds must be at least 1, got {rounds}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightSpeedError(f"no such file: {', '.join(missing)}")
    if len({f.name for f in files}) != len(files):
        raise WeightSpeedError("two files share a name; the results are keyed by file name")
    infos = [file_info(f, foreign) for f in files]
    if runner is None:
        exe = bench or tools.binary("llama-bench")
        def runner(f: Path) -> dict[str, float]:
            return run_llama_bench(exe, f, n_prompt=n_prompt, n_gen=n_gen, threads=threads, timeout=timeout)
    t0 = time.time()
    samples: list[list[dict[str, float]]] = []  # [round][file]
    for r in range(rounds):
        row = []
        for f in files:
            progress(f"[weight-speed] round {r + 1}/{rounds}: {f.name}")
            row.append(runner(f))
        samples.append(row)
    return result(infos, samples, meta={
        "machine": machine.describe(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {"rounds": rounds, "n_prompt": n_prompt, "n_gen": n_gen, "threads": threads,
                     "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")},
        "seconds": round(time.time() - t0, 1)})


def result(infos: Sequence[FileInfo], samples: Sequence[Sequence[dict[str, float]]], *, meta: dict) -> dict:
    """Per file the rounds' t/s, their summaries, and the per-round ratios to file 0 with their summaries."""
    rows = []
    for i, info in enumerate(infos):
        row: dict = {"file": asdict(info)}
        for k in ("pp", "tg"):
            xs = [s[i][k] for s in samples if k in s[i]]
            if not xs:
                continue
            ratios = [s[i][k] / s[0][k] for s in samples]
            row[k] = {"ts": xs, **summary(xs), "ratios": ratios, "ratio": summary(ratios)}
        rows.append(row)
    return {**meta, "order": [[info.name for info in infos] for _ in samples], "rows": rows}


def _types(types: dict[str, int], n: int) -> str:
    return ", ".join(f"{t} {100 * c / n:.0f}%" for t, c in types.items() if 100 * c / n >= 0.5)


def to_markdown(res: dict, title: str = "Weight-type speed") -> str:
    s = res["settings"]
    base = res["rows"][0]["file"]["name"]
    lines = [f"# {title}", "",
             f"llama-bench pp{s['n_prompt']} / tg{s['n_gen']}, {s['threads']} thread{'s' * (s['threads'] != 1)}, "
             f"{s['rounds']} interleaved "
             f"rounds (each file once per round, one repetition), {res['machine']['cpu']} "
             f"({res['machine']['cores']} cores), {res['date']}, {res['seconds']:.0f} s. "
             f"t/s: median [min-max]; ratio: median of the per-round ratios to **{base}** [min-max].", "",
             "| file | MiB | bpw | pp t/s | pp ratio | tg t/s | tg ratio |", "|---|---:|---:|---:|---:|---:|---:|"]

    def cell(x: dict | None, key: str, fmt: str) -> str:
        if not x:
            return "-"
        v = x["ratio"] if key == "ratio" else x
        return f"{v['median']:{fmt}} [{v['min']:{fmt}}-{v['max']:{fmt}}]"

    for r in res["rows"]:
        f = r["file"]
        lines.append(f"| {f['name']} | {f['size_mib']:.0f} | {f['bpw']:.3f} | {cell(r.get('pp'), 'ts', '.2f')} | "
                     f"{cell(r.get('pp'), 'ratio', '.3f')} | {cell(r.get('tg'), 'ts', '.2f')} | "
                     f"{cell(r.get('tg'), 'ratio', '.3f')} |")
    lines += ["", "Tensor types by share of parameters:", ""]
    lines += [f"- {r['file']['name']}: {_types(r['file']['types'], r['file']['n_params'])}" for r in res["rows"]]
    return "\n".join(lines) + "\n"
