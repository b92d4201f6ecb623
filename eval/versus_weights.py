"""Weight types beside the alternatives: each build quantises the same F16 file with its own llama-quantize (and its
own importance matrix from the same calibration tokens), and scores the result with its own llama-perplexity against
its own F16 logits; speed is llama-bench of the same build over its own Q4_K_M, in interleaved rounds.

A variant is "BUILD:FTYPE[+imat] [llama-quantize ARGS...]" (``ik:IQ3_KT+imat``, ``ik:IQ3_KT+imat --custom-q
ffn_down=iq4_kt``); for ours, FTYPE may be an rq-convert recipe (``ours:itq3-m``: calibrated on the same calibration
text, as rq-convert does by default). The F16 file is the requantisation rq-eval weights makes (rotaryquant.eval.weights), with the same
context, chunks and calibration tokens, so rows of ``rq-eval weights`` on our build sit beside these.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rotaryquant.converter.recipes import RECIPES
from rotaryquant.eval import builds as B
from rotaryquant.eval import perplexity, weights, weightspeed
from rotaryquant.eval.versus import VersusError, _failure, _run, split_spec


@dataclass(frozen=True)
class WVariant:
    build: str
    ftype: str
    imatrix: bool = False
    args: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.build}:{self.ftype}" + ("+imat" if self.imatrix else "") + "".join(" " + a for a in self.args)

    @property
    def file_label(self) -> str:
        return weights._file_label(self.label.replace(":", "-").replace(" ", "_"))[:120]


def parse_variant(spec: str, names: Sequence[str]) -> WVariant:
    name, words = split_spec(spec, names, "a weight variant BUILD:FTYPE[+imat] [ARGS...]")
    ftype, imat = words[0].removesuffix("+imat"), words[0].endswith("+imat")
    return WVariant(name, ftype, imat, tuple(words[1:]))


def _recipes() -> set[str]:
    return set(RECIPES)


def _imatrix_name(b: B.Build) -> str:
    """The file name the build's llama-imatrix writes in a format its llama-quantize reads: GGUF where the tool knows
    --output-format (upstream), the legacy .dat otherwise (ik_llama.cpp)."""
    _, out, err, _ = _run([str(b.tool("llama-imatrix")), "--help"])
    return f"{b.name}.imatrix.gguf" if "output-format" in out + err else f"{b.name}.imatrix.dat"


def _check(rc: int, out: str, err: str, cmd: list[str], what: str) -> None:
    if rc != 0:
        f = _failure(rc, out + err)
        raise VersusError(f"{what} failed ({f['error']}): " + " / ".join(f["log_tail"][-3:]))


def quality(builds: dict[str, B.Build], variants: Sequence[WVariant], src: Path, work: Path, eval_text: Path,
            calib_text: Path, *, ctx: int = 512, chunks: int = 10, imatrix_chunks: int = 8, threads: int = 2,
            reuse: bool = False, progress: Callable[[str], None] = print) -> list[dict]:
    """Per build: F16 logits, an importance matrix if a variant needs one, then each variant quantised and scored.
    Quantised files stay in ``work`` (the speed rounds read them); a variant that fails is a row with its error.
    ``reuse`` scores a variant's file already in ``work`` instead of quantising again: a file there is complete,
    since it is renamed from ``.partial`` only when its quantiser succeeded."""
    work.mkdir(parents=True, exist_ok=True)
    f16 = weights.requantize_f16(src, work / f"{src.stem}.F16.gguf")
    n_params = weights._n_params(f16)
    rows = []
    for name in dict.fromkeys(v.build for v in variants):
        b = builds[name]
        base = work / f"{name}.F16.c{ctx}x{chunks}.kld"
        ppl_cmd = [str(b.tool("llama-perplexity")), "-f", str(eval_text), "-c", str(ctx), "--chunks", str(chunks),
                   "-t", str(threads)]
        if not base.exists():
            progress(f"[rq-eval versus-weights] {name}: F16 logits")
            tmp = base.with_suffix(".partial")
            cmd = [*ppl_cmd, "-m", str(f16), "--kl-divergence-base", str(tmp)]
            rc, out, err, _ = _run(cmd)
            _check(rc, out, err, cmd, f"{name} llama-perplexity on F16")
            tmp.replace(base)
        imat = work / _imatrix_name(b)
        if any(v.imatrix for v in variants if v.build == name) and not imat.exists():
            progress(f"[rq-eval versus-weights] {name}: importance matrix ({imatrix_chunks} x {ctx} tokens)")
            tmp = imat.with_name("partial-" + imat.name)
            cmd = [str(b.tool("llama-imatrix")), "-m", str(f16), "-f", str(calib_text), "-o", str(tmp), "--chunks",
                   str(imatrix_chunks), "-c", str(ctx), "-t", str(threads)]
            rc, out, err, _ = _run(cmd)
            _check(rc, out, err, cmd, f"{name} llama-imatrix")
            tmp.replace(imat)
        for v in (v for v in variants if v.build == name):
            progress(f"[rq-eval versus-weights] {v.label}")
            q = work / f"{v.file_label}.gguf"
            row: dict = {"label": v.label, "build": name, "ftype": v.ftype, "imatrix": v.imatrix, "args": list(v.args),
                         "ctx": ctx, "chunks": chunks, "calib_tokens": imatrix_chunks * ctx, "file": q.name}
            t0 = time.time()
            cmd = [str(b.tool("llama-quantize")), *(["--imatrix", str(imat)] if v.imatrix else []), *v.args,
                   str(f16), str(q) + ".partial", v.ftype, str(threads)]
            if name == "ours" and v.ftype in _recipes():
                cmd = [sys.executable, "-m", "rotaryquant.converter.cli", str(f16), str(q) + ".partial", "--recipe",
                       v.ftype, "--no-promote", "--threads", str(threads), "--no-progress", "--table", "none",
                       "--calibrate", str(calib_text), *v.args]
            row["quantize_command"] = shlex.join(cmd)
            if reuse and q.exists():
                row["reused_file"] = True
                progress(f"[rq-eval versus-weights]   scoring the existing {q.name}")
            else:
                rc, out, err, _ = _run(cmd)
                if rc != 0:
                    rows.append({**row, **_failure(rc, out + err), "command": shlex.join(cmd)})
                    continue
                Path(str(q) + ".partial").replace(q)
                row["quantize_s"] = round(time.time() - t0, 1)
            cmd = [*ppl_cmd, "-m", str(q), "--kl-divergence-base", str(base), "--kl-divergence"]
            rc, out, err, secs = _run(cmd)
            row["command"] = shlex.join(cmd)
            if rc != 0:
                rows.append({**row, **_failure(rc, out + err)})
                continue
            r = perplexity.parse_output(v.label, out + err)
            row.update({"bytes": q.stat().st_size, "bpw": round(8 * q.stat().st_size / n_params, 4), "ppl": r.ppl,
                        "ppl_base": perplexity._grab(r"Mean PPL\(base\)\s*:\s*" + perplexity._NUM, out + err), "kld_mean": r.kld_mean, "kld_p99": r.kld_p99, "same_top_p": r.same_top_p,
                        "ppl_ratio": r.ppl_ratio, "seconds": round(secs, 1)})
            rows.append(row)
            progress(f"[rq-eval versus-weights]   {row['bpw']:.3f} bpw, KLD {r.kld_mean:.4f}, p99 {r.kld_p99:.3f}")
    return rows


def speed(builds: dict[str, B.Build], variants: Sequence[WVariant], src: Path, work: Path, *,
          threads: Sequence[int] = (1, 2), rounds: int = 3, n_prompt: int = 512, n_gen: int = 64,
          baseline: str = "Q4_K_M", progress: Callable[[str], None] = print) -> list[dict]:
    """Per build and thread count: llama-bench over the build's own `baseline` quantisation of the F16 file first, then
    each variant's file (quality() made them), in interleaved rounds; ratios are to the baseline in the same round."""
    f16 = work / f"{src.stem}.F16.gguf"
    missing = [v.label for v in variants if not (work / f"{v.file_label}.gguf").exists()]
    if missing:  # refused before anything runs: a variant left out silently would look measured
        raise VersusError(f"no quantised file in {work} for {', '.join(missing)}",
                      fix="measure its quality first (that run makes the file), with the variant spelled as then")
    out = []
    for name in dict.fromkeys(v.build for v in variants):
        b = builds[name]
        base = work / f"{name}-{baseline}.gguf"
        if not base.exists():
            progress(f"[rq-eval versus-weights] {name}: {baseline} for the speed baseline")
            cmd = [str(b.tool("llama-quantize")), str(f16), str(base) + ".partial", baseline, "2"]
            rc, o, e, _ = _run(cmd)
            _check(rc, o, e, cmd, f"{name} llama-quantize {baseline}")
            Path(str(base) + ".partial").replace(base)
        files = [base, *(f for v in variants if v.build == name and (f := work / f"{v.file_label}.gguf").exists())]
        for t in threads:
            res = weightspeed.measure(files, rounds=rounds, n_prompt=n_prompt, n_gen=n_gen, threads=t,
                                      bench=b.tool("llama-bench"), progress=progress, foreign=name != "ours")
            labels = {f"{v.file_label}.gguf": v.label for v in variants}
            for r in res["rows"]:
                r["label"] = labels.get(r["file"]["name"], f"{name}:{baseline}")
                r["build"], r["threads"] = name, t
            out += res["rows"]
    return out


def merge_speed(old: list[dict], rows: list[dict], run: int, runs: Sequence[Sequence[str]] = (),
                baseline: str = "Q4_K_M") -> list[dict]:
    """``rows`` (measured by ``runs[run]``) plus the rows of ``old`` this run did not measure again (same build,
    threads and variant): each row keeps its ratios to the baseline of its own run, and says which run that was (an
    older row without one was measured by the last earlier run that measured speed). A build's baseline row of an
    earlier run stays while rows of that run do: every run measures its own."""
    def measured_speed(argv: Sequence[str]) -> bool:
        m = "quality,speed"  # the default
        for a, b in zip(argv, [*argv[1:], ""]):
            m = b if a == "--measure" else a.split("=", 1)[1] if a.startswith("--measure=") else m
        return "speed" in m.split(",")

    before = next((i for i in range(run - 1, -1, -1) if i < len(runs) and measured_speed(runs[i])), None)
    new = {(r["build"], r["threads"], r["label"]) for r in rows}
    old = [{**r, "run": r.get("run", before)} for r in old]

    def is_base(r: dict) -> bool:
        return r["label"] == f"{r['build']}:{baseline}"
    used = {(r["build"], r["threads"], r["run"]) for r in old
            if not is_base(r) and (r["build"], r["threads"], r["label"]) not in new}
    kept = [r for r in old if (r["build"], r["threads"], r["label"]) not in new
            or is_base(r) and (r["build"], r["threads"], r["run"]) in used]
    return kept + [{**r, "run": run} for r in rows]


def to_markdown(res: dict) -> str:
    def f(x: float | None, nd: int = 4) -> str:
        return "–" if x is None else f"{x:.{nd}f}"

    def cell(label: str) -> str:  # a --custom-q regex may hold "|": escaped, or it splits the table's row
        return label.replace("|", "\\|")

    lines = [f"## Weight types beside the alternatives: {res['model']}", "",
             f"Each build quantises the same F16 requantisation with its own llama-quantize (+imat: its own llama-imatrix "
             f"over the first {res['calib_tokens']} tokens of the calibration slice) and scores it with its own "
             f"llama-perplexity (ctx {res['ctx']}, {res['chunks']} chunks of the evaluation slice) against its own F16 "
             "logits. bpw: file bytes × 8 / parameters.", "",
             "| variant | bpw | PPL | ΔPPL | mean KLD | KLD p99 | same top-1 % |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res.get("quality", []):
        if "error" in r:
            lines.append(f"| {cell(r['label'])} | – | did not run ({r['error']}: {' / '.join(r['log_tail'][-1:])}) | | | | |")
            continue
        d = r["ppl"] - r["ppl_base"] if r.get("ppl_base") is not None else None
        lines.append(f"| {cell(r['label'])} | {r['bpw']:.3f} | {r['ppl']:.3f} | {'–' if d is None else f'{d:+.3f}'} "
                     f"| {f(r['kld_mean'])} | {f(r['kld_p99'])} | {f(r['same_top_p'], 2)} |")
    sp = res.get("speed") or []
    runs = len({r.get("run") for r in sp}) > 1  # rows of several runs: t/s move between runs, ratios do not
    if sp:
        lines += ["", "Speed: llama-bench of the same build, interleaved rounds; ratio = median of the per-round ratios "
                  "to that build's Q4_K_M (made by its own llama-quantize from the same F16)"
                  + (" in the same run (`run`: its index in the JSON's `runs`; compare t/s within one run only)."
                     if runs else "."), "",
                  "| variant | threads | pp t/s | pp × Q4_K_M | tg t/s | tg × Q4_K_M |" + (" run |" if runs else ""),
                  "|---|---:|---:|---:|---:|---:|" + ("---:|" if runs else "")]
        for r in sorted(sp, key=lambda r: (r.get("run") or 0) if runs else 0):
            pp, tg = r.get("pp") or {}, r.get("tg") or {}
            lines.append(f"| {cell(r['label'])} | {r['threads']} | {f(pp.get('median'), 2)} "
                         f"| {f((pp.get('ratio') or {}).get('median'), 3)} | {f(tg.get('median'), 2)} "
                         f"| {f((tg.get('ratio') or {}).get('median'), 3)} |"
                         + (f" {'–' if r.get('run') is None else r['run']} |" if runs else ""))
    return "\n".join(lines) + "\n"
