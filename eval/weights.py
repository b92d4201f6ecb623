"""Weight types side by side: size, PPL/KLD against the model's own F16, and CPU speed, in one run.

The default models ship 4-bit GGUFs; they are requantised to F16 first (the baseline every type is
measured against, as models.md prescribes), then quantised with the patched llama-quantize. Two
modes: ``ftype`` (llama-quantize's positional type, with its usual mixture and fallbacks) and
``tensor`` (Q8_0 everywhere except the tensors given by ``--tensor-type`` - an A/B of the type
itself on identical tensor sets, needed when most rows of a small model are not multiples of 256).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rotaryquant.bindings import tools
from rotaryquant.eval import perplexity


class WeightsBenchError(RuntimeError):
    """A step failed; the message names it."""


@dataclass(frozen=True)
class Variant:
    label: str
    ftype: str  # llama-quantize positional type
    imatrix: bool = False
    tensor_type: str | None = None  # "regex=type" for tensor mode


# the comparison set; IQ3_XXS needs an importance matrix
DEFAULT_VARIANTS = (
    Variant("Q4_K_M", "Q4_K_M"),
    Variant("Q3_K_S", "Q3_K_S"),
    Variant("IQ3_S", "IQ3_S"),
    Variant("IQ3_S+imat", "IQ3_S", imatrix=True),
    Variant("IQ3_XXS+imat", "IQ3_XXS", imatrix=True),
    Variant("ITQ3_S", "ITQ3_S"),
    Variant("ITQ3_S+imat", "ITQ3_S", imatrix=True),
)


def tensor_variants(pattern: str = "ffn_down") -> tuple[Variant, ...]:
    """The same types on one tensor role only, everything else Q8_0."""
    out = [Variant("Q8_0", "Q8_0")]
    for v in DEFAULT_VARIANTS:
        t = {"Q4_K_M": "q4_K", "Q3_K_S": "q3_K"}.get(v.ftype, v.ftype.lower())
        out.append(Variant(f"{pattern}={t}" + ("+imat" if v.imatrix else ""), "Q8_0", v.imatrix, f"{pattern}={t}"))
    return tuple(out)


def _run(cmd: list[str], what: str, timeout: float = 7200) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-6:])
        raise WeightsBenchError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return out


def requantize_f16(src: Path, dst: Path) -> Path:
    if not dst.exists():
        tmp = dst.with_suffix(".partial")
        _run([tools.binary("llama-quantize"), "--allow-requantize", src, tmp, "F16"], f"requantising {src.name} to F16")
        tmp.replace(dst)
    return dst


def make_imatrix(model: Path, calib: Path, dst: Path, *, chunks: int, ctx: int, threads: int) -> Path:
    if not dst.exists():
        tmp = dst.with_name(dst.stem + ".partial.gguf")
        _run([tools.binary("llama-imatrix"), "-m", model, "-f", calib, "-o", tmp, "--chunks", str(chunks),
              "-c", str(ctx), "-t", str(threads)], "llama-imatrix")
        tmp.replace(dst)
    return dst


def quantize(f16: Path, v: Variant, dst: Path, imatrix: Path | None, threads: int) -> Path:
    cmd: list = [tools.binary("llama-quantize")]
    if v.imatrix:
        if imatrix is None:
            raise WeightsBenchError(f"{v.label} needs an importance matrix")
        cmd += ["--imatrix", imatrix]
    if v.tensor_type:
        cmd += ["--tensor-type", v.tensor_type]
    tmp = dst.with_suffix(".partial")
    _run([*cmd, f16, tmp, v.ftype, str(threads)], f"llama-quantize {v.label}")
    tmp.replace(dst)
    return dst


def speed(model: Path, *, threads: int, reps: int, n_prompt: int = 256, n_gen: int = 64) -> dict:
    out = _run([tools.binary("llama-bench"), "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
                "-t", str(threads), "-o", "json"], f"llama-bench {model.name}")
    recs = json.loads(out[out.index("["):out.rindex("]") + 1])
    res = {}
    for r in recs:
        key = "pp_tps" if int(r["n_gen"]) == 0 else "tg_tps"
        res[key] = float(r["avg_ts"])
        res[key.replace("tps", "std")] = float(r["stddev_ts"])
    return res


def bench(src: Path, workdir: Path, eval_text: Path, calib_text: Path, *, variants=DEFAULT_VARIANTS, ctx: int = 512,
          chunks: int = 20, imatrix_chunks: int = 40, threads: int = 2, reps: int = 2, progress=print) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stem = src.stem
    f16 = requantize_f16(src, workdir / f"{stem}.F16.gguf")
    imat = None
    if any(v.imatrix for v in variants):
        progress("[rq-eval] importance matrix from the calibration text")
        imat = make_imatrix(f16, calib_text, workdir / f"{stem}.imatrix.gguf", chunks=imatrix_chunks, ctx=ctx, threads=threads)
    base_logits = workdir / f"{stem}.F16.kld"
    progress("[rq-eval] F16 baseline perplexity (saving logits)")
    base = perplexity.run(f16, eval_text, label="F16", ctx=ctx, chunks=chunks, kld_base=base_logits, save_base=True,
                          threads=threads)
    rows = [{"label": "F16", "bytes": f16.stat().st_size, **base.as_dict(), **speed(f16, threads=threads, reps=reps)}]
    for v in variants:
        progress(f"[rq-eval] {v.label}")
        q = quantize(f16, v, workdir / f"{stem}.{v.label.replace('=', '-').replace('+', '-')}.gguf", imat, threads)
        r = perplexity.run(q, eval_text, label=v.label, ctx=ctx, chunks=chunks, kld_base=base_logits, threads=threads)
        rows.append({"label": v.label, "bytes": q.stat().st_size, **r.as_dict(), **speed(q, threads=threads, reps=reps)})
        q.unlink()
    base_logits.unlink(missing_ok=True)
    n_params = _n_params(f16)
    for r in rows:
        r["bpw"] = 8.0 * r["bytes"] / n_params
    return {"model": src.name, "params": n_params, "ctx": ctx, "chunks": chunks, "seconds": round(time.time() - t0),
            "rows": rows}


def _n_params(model: Path) -> int:
    import gguf

    r = gguf.GGUFReader(str(model))
    n = 0
    for t in r.tensors:
        k = 1
        for d in t.shape:
            k *= int(d)
        n += k
    return n


def to_markdown(res: dict, title: str) -> str:
    def f(x, nd=4):
        return "–" if x is None else f"{x:.{nd}f}"

    lines = [f"## {title}: {res['model']} ({res['params'] / 1e6:.1f} M parameters)", "",
             f"ctx {res['ctx']}, {res['chunks']} chunks; KLD against the F16 requantisation of the same model; "
             "t/s from llama-bench pp256/tg64, 2 threads, in the same run.", "",
             "| type | size MiB | bpw | PPL | ΔPPL | mean KLD | KLD p99 | same top-1 % | pp t/s | tg t/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = res["rows"][0]["ppl"]
    for r in res["rows"]:
        lines.append(f"| {r['label']} | {r['bytes'] / 2**20:.1f} | {r['bpw']:.2f} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} "
                     f"| {f(r['kld_mean'])} | {f(r['kld_p99'])} | {f(r['same_top_p'], 2)} | {f(r.get('pp_tps'), 1)} "
                     f"| {f(r.get('tg_tps'), 1)} |")
    return "\n".join(lines) + "\n"
