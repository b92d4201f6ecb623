"""Weight types side by side: size, PPL/KLD against the model's own F16, and CPU speed, in one run.

The default models ship 4-bit GGUFs; they are requantised to F16 first (the baseline every type is
measured against, as models.md prescribes), then quantised with the patched llama-quantize. Two
modes: ``ftype`` (llama-quantize's positional type, with its usual mixture and fallbacks) and
``tensor`` (Q8_0 everywhere except the tensors given by ``--tensor-type`` - an A/B of the type
itself on identical tensor sets, needed when most rows of a small model are not multiples of 256).

Calibration is the same text for every variant (the calibration slice, disjoint from the scored
slice) and the same number of tokens: llama-imatrix for ``+imat`` rows, ``rq-convert --calibrate``
(second-order statistics for ITQ3_S, through the same recipe without them as its own control) for
``+cal`` rows. A work folder keeps the F16 file, the importance matrix and the baseline logits, so a
run can be extended variant by variant (``only`` + ``merge``); speed is measured separately
(``rq-eval weight-speed``: interleaved rounds), because one llama-bench call per file is noise here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import gguf_io
from rotaryquant.bindings import tools
from rotaryquant.errors import RQError
from rotaryquant.eval import perplexity


class WeightsBenchError(RQError):
    """A step failed; the message names it."""


@dataclass(frozen=True)
class Variant:
    label: str
    ftype: str  # llama-quantize positional type
    imatrix: bool = False
    tensor_type: str | None = None  # "regex=type" for tensor mode
    recipe: str | None = None       # made by rq-convert with this recipe, not llama-quantize
    calibrate: bool = False         # rq-convert --calibrate on the calibration text
    promote: bool = False           # rq-convert's kurtosis promotion on (the recipe as users run it)
    overrides: tuple[str, ...] = () # --tensor-type REGEX=TYPE, in order (rq-convert or llama-quantize)


CALIB_TOKENS = 4096  # calibration tokens for every calibrated variant (8 imatrix chunks of 512)

# every 3-4 bit llama-quantize type users compare ITQ3_S with, each with and without an importance
# matrix, and ITQ3_S through rq-convert with and without second-order calibration
DEFAULT_VARIANTS = (
    *(Variant(label + suffix, label, imatrix=bool(suffix))
      for label in ("Q4_K_M", "Q3_K_M", "Q3_K_S", "IQ3_S", "ITQ3_S") for suffix in ("", "+imat")),
    # llama-quantize's IQ3_XXS mixture puts some tensors in IQ2_S, which refuses to run without an imatrix
    Variant("IQ3_XXS+imat", "IQ3_XXS", imatrix=True),
    Variant("IQ3_M+imat", "IQ3_M", imatrix=True),   # llama-quantize's own IQ3_S mixture
    Variant("ITQ3_S/rq", "ITQ3_S", recipe="itq3"),
    Variant("ITQ3_S/rq+cal", "ITQ3_S", recipe="itq3", calibrate=True),
    # `rq-convert --recipe itq3-m` as it runs by default (calibrated, no promotion): IQ3_S's size spent as
    # llama-quantize's _M types spend bits: untied token embeddings (a lookup, not a matmul) ITQ3_S instead of Q4_K,
    # the saving spent on attn_k/attn_v (Q6_K, 1.2% of the weights) and ffn_down (Q4_K outside the middle quarter of
    # the layers: 21 of 28 on Qwen2.5-1.5B)
    Variant("ITQ3_S-M/rq+cal", "ITQ3_S", recipe="itq3-m", calibrate=True),
    # the control for the row above: the same mixture with IQ3_S + imatrix where ITQ3_S is (llama-quantize
    # --tensor-type), so the table says what the format adds and what the bit allocation adds
    Variant("IQ3_S-M+imat", "IQ3_S", imatrix=True,
            overrides=("token_embd=iq3_s", r"attn_[kv]\.=q6_K", r"blk\.([0-9]|1[7-9]|2[0-9])\.ffn_down=q4_K")),
    # the default recipe as `rq-convert model/ out.gguf` makes it (dense weights 4-bit, kurtosis promotion on)
    Variant("rotaryquant", "Q4_K_M", recipe="rotaryquant", promote=True),
)


def tensor_variants(pattern: str = "ffn_down") -> tuple[Variant, ...]:
    """The same types on one tensor role only, everything else Q8_0."""
    out = [Variant("Q8_0", "Q8_0")]
    for v in DEFAULT_VARIANTS:
        if v.recipe:
            continue
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


def quantize(f16: Path, v: Variant, dst: Path, imatrix: Path | None, threads: int, calib_text: Path | None = None) -> Path:
    if v.recipe:
        return convert(f16, v, dst, calib_text, threads)
    cmd: list = [tools.binary("llama-quantize")]
    if v.imatrix:
        if imatrix is None:
            raise WeightsBenchError(f"{v.label} needs an importance matrix")
        cmd += ["--imatrix", imatrix]
    if v.tensor_type:
        cmd += ["--tensor-type", v.tensor_type]
    for o in v.overrides:
        cmd += ["--tensor-type", o]
    tmp = dst.with_suffix(".partial")
    _run([*cmd, f16, tmp, v.ftype, str(threads)], f"llama-quantize {v.label}")
    tmp.replace(dst)
    return dst


def convert(f16: Path, v: Variant, dst: Path, calib_text: Path | None, threads: int) -> Path:
    """rq-convert with ``v.recipe``; kurtosis promotion off unless ``v.promote`` (so the ITQ3_S rows' tensor types
    are llama-quantize's)."""
    cmd: list = [sys.executable, "-m", "rotaryquant.converter.cli", f16, dst, "--recipe", v.recipe,
                 *(() if v.promote else ("--no-promote",)), "--threads", str(threads), "--no-progress", "--table", "none"]
    for o in v.overrides:
        cmd += ["--tensor-type", o]
    if v.calibrate:
        if calib_text is None:
            raise WeightsBenchError(f"{v.label} needs calibration text")
        cmd += ["--calibrate", calib_text]
    else:
        cmd += ["--no-calibrate"]   # the plain row is the control (ITQ3_S recipes calibrate by default)
    _run(cmd, f"rq-convert {v.label}")
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
          chunks: int = 20, imatrix_chunks: int = CALIB_TOKENS // 512, threads: int = 2, reps: int = 0,
          merge: dict | None = None, on_row=None, progress=print) -> dict:
    """Quantise ``src``'s F16 requantisation per variant and score it against F16's logits.

    Files in ``workdir`` (F16, importance matrix, baseline logits) are reused when present. ``merge``: an
    earlier result of the same model and settings; its rows are kept unless a variant here replaces them.
    ``reps`` > 0 adds llama-bench columns (noisy; ``rq-eval weight-speed`` is the speed measurement).
    ``on_row``: called with the result so far after every row (a long run that stops keeps what it measured).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stem = src.stem
    f16 = requantize_f16(src, workdir / f"{stem}.F16.gguf")
    if merge is not None and (merge.get("model"), merge.get("ctx"), merge.get("chunks")) != (src.name, ctx, chunks):
        raise WeightsBenchError(f"cannot merge into a result for {merge.get('model')} ctx {merge.get('ctx')} "
                                f"chunks {merge.get('chunks')}: this run is {src.name} ctx {ctx} chunks {chunks}")
    imat = None
    if any(v.imatrix for v in variants):
        progress("[rq-eval] importance matrix from the calibration text")
        imat = make_imatrix(f16, calib_text, workdir / f"{stem}.imatrix.gguf", chunks=imatrix_chunks, ctx=ctx, threads=threads)
    base_logits = workdir / f"{stem}.F16.c{ctx}x{chunks}.kld"
    rows = {r["label"]: r for r in (merge or {}).get("rows", [])}
    n_params = _n_params(f16)

    def result() -> dict:
        for r in rows.values():
            r["bpw"] = 8.0 * r["bytes"] / n_params
        order = ["F16"] + [label for label in rows if label != "F16"]
        return {"model": src.name, "params": n_params, "ctx": ctx, "chunks": chunks, "calib_tokens": imatrix_chunks * ctx,
                "seconds": round(time.time() - t0) + int((merge or {}).get("seconds", 0)),
                "rows": [rows[k] for k in order if k in rows]}

    if "F16" not in rows or not base_logits.exists():
        progress("[rq-eval] F16 baseline perplexity (saving logits)")
        tmp = base_logits.with_suffix(".partial")
        base = perplexity.run(f16, eval_text, label="F16", ctx=ctx, chunks=chunks, kld_base=tmp, save_base=True,
                              threads=threads)
        tmp.replace(base_logits)
        rows["F16"] = {"label": "F16", "bytes": f16.stat().st_size, **base.as_dict(),
                       **(speed(f16, threads=threads, reps=reps) if reps else {})}
        if on_row:
            on_row(result())
    for v in variants:
        progress(f"[rq-eval] {v.label}")
        q = quantize(f16, v, workdir / f"{stem}.{_file_label(v.label)}.gguf", imat, threads, calib_text)
        r = perplexity.run(q, eval_text, label=v.label, ctx=ctx, chunks=chunks, kld_base=base_logits, threads=threads)
        rows[v.label] = {"label": v.label, "bytes": q.stat().st_size, **r.as_dict(), "types": tensor_types(q),
                         **(speed(q, threads=threads, reps=reps) if reps else {})}
        q.unlink()
        if on_row:
            on_row(result())
    return result()


def _file_label(label: str) -> str:
    return label.replace("=", "-").replace("+", "-").replace("/", "-")


def tensor_types(model: Path) -> dict[str, int]:
    """Weights per tensor type in a GGUF (what a ftype mixture really holds)."""
    out: dict[str, int] = {}
    for t in gguf_io.open_reader(model).tensors:
        n = 1
        for d in t.shape:
            n *= int(d)
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + n
    return out


def _n_params(model: Path) -> int:
    r = gguf_io.open_reader(model)
    n = 0
    for t in r.tensors:
        k = 1
        for d in t.shape:
            k *= int(d)
        n += k
    return n


def _mixture(types: dict[str, int] | None) -> str:
    if not types:
        return "–"
    total = sum(types.values())
    top = sorted(types.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in top if n / total >= 0.01)


def to_markdown(res: dict, title: str) -> str:
    def f(x, nd=4):
        return "–" if x is None else f"{x:.{nd}f}"

    timed = any(r.get("tg_tps") is not None for r in res["rows"])
    calib = (f" Calibration: the first {res['calib_tokens']} tokens of the calibration slice for every +imat/+cal row."
             if res.get("calib_tokens") else "")
    lines = [f"## {title}: {res['model']} ({res['params'] / 1e6:.1f} M parameters)", "",
             f"ctx {res['ctx']}, {res['chunks']} chunks of the evaluation slice; KLD against the F16 requantisation of "
             "the same model." + calib + (" t/s from llama-bench pp256/tg64, 2 threads, in the same run (one call per "
             "file: noisy)." if timed else " Speed: `rq-eval weight-speed` (interleaved rounds)."), "",
             "| type | size MiB | bpw | PPL | ΔPPL | mean KLD | KLD p99 | same top-1 % |"
             + (" pp t/s | tg t/s |" if timed else " weights by type |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else "---|")]
    base = res["rows"][0]["ppl"]
    for r in res["rows"]:
        tail = (f" {f(r.get('pp_tps'), 1)} | {f(r.get('tg_tps'), 1)} |" if timed else f" {_mixture(r.get('types'))} |")
        lines.append(f"| {r['label']} | {r['bytes'] / 2**20:.1f} | {r['bpw']:.2f} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} "
                     f"| {f(r['kld_mean'])} | {f(r['kld_p99'])} | {f(r['same_top_p'], 2)} |" + tail)
    return "\n".join(lines) + "\n"
