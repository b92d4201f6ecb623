"""KV-cache quality: perplexity and KL divergence of each cache type against F16 KV, per context size."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from rotaryquant.eval import perplexity


def run(model: Path, text: Path, *, kv_types: list[str], ctxs: list[int], chunks: int, unfused: bool = False,
        threads: int = 2, progress=print) -> dict:
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rq-kld-") as tmp:
        for ctx in ctxs:
            base_file = Path(tmp) / f"base-{ctx}.kld"
            progress(f"[rq-eval] ctx {ctx}: f16 KV baseline")
            base = perplexity.run(model, text, label="f16", ctx=ctx, chunks=chunks, kld_base=base_file, save_base=True,
                                  threads=threads)
            rows.append({"ctx": ctx, "unfused": False, **base.as_dict()})
            runs = [(t, False) for t in kv_types if t != "f16"]
            if unfused and "isoquant3_0" in kv_types:
                runs.append(("isoquant3_0", True))
            for t, unf in runs:
                label = t + ("-unfused" if unf else "")
                progress(f"[rq-eval] ctx {ctx}: {label}")
                r = perplexity.run(model, text, label=label, ctx=ctx, chunks=chunks, cache_type=t, unfused=unf,
                                   kld_base=base_file, threads=threads)
                rows.append({"ctx": ctx, "unfused": unf, **r.as_dict()})
            base_file.unlink()
    return {"model": model.name, "text": text.name, "chunks": chunks, "seconds": round(time.time() - t0), "rows": rows}


def to_markdown(res: dict) -> str:
    def f(x, nd=4):
        return "–" if x is None else f"{x:.{nd}f}"

    lines = [f"## KV-cache quality: {res['model']}", "",
             f"Text {res['text']}, {res['chunks']} chunks per context; KLD against the F16-KV run of the same model.", "",
             "| ctx | cache | PPL | ΔPPL | mean KLD | KLD p99 | same top-1 % | s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    base = {r["ctx"]: r["ppl"] for r in res["rows"] if r["label"] == "f16"}
    for r in res["rows"]:
        lines.append(f"| {r['ctx']} | {r['label']} | {r['ppl']:.3f} | {r['ppl'] - base[r['ctx']]:+.3f} | {f(r['kld_mean'])} "
                     f"| {f(r['kld_p99'])} | {f(r['same_top_p'], 2)} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"
