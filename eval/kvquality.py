"""KV-cache quality: perplexity and KL divergence of each cache type against F16 KV, per context size.

llama-perplexity scores every token as prefill. With deferred=True each non-f16 type also runs with
deferred prefill (LLAMA_KV_DEFERRED=1, label "TYPE deferred"): the prompt then attends an exact F16
copy of its K/V, so those rows show llama-perplexity going blind to the cache (KLD ~0), not decode
quality; that is what `rq-eval decode` measures."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from rotaryquant.bindings.accounting import kv_bits_or_none
from rotaryquant.eval import perplexity


def run(model: Path, text: Path, *, kv_types: list[str], ctxs: list[int], chunks: int, unfused: bool = False,
        deferred: bool = False, threads: int = 2, progress=print) -> dict:
    rows = []
    t0 = time.time()
    bits = kv_bits_or_none(model, ["f16", *kv_types], max(ctxs), progress)
    with tempfile.TemporaryDirectory(prefix="rq-kld-") as tmp:
        for ctx in ctxs:
            base_file = Path(tmp) / f"base-{ctx}.kld"
            progress(f"[rq-eval] ctx {ctx}: f16 KV baseline")
            base = perplexity.run(model, text, label="f16", ctx=ctx, chunks=chunks, kld_base=base_file, save_base=True,
                                  threads=threads)
            rows.append({"ctx": ctx, "unfused": False, "deferred": False, "bits_per_value": bits.get("f16"), **base.as_dict()})
            runs = [(t, False, False) for t in kv_types if t != "f16"]
            if deferred:  # each type's deferred run beside its plain one: the contrast is the point
                runs = [r for t, _, _ in runs for r in ((t, False, False), (t, False, True))]
            if unfused and "isoquant3_0" in kv_types:
                runs.append(("isoquant3_0", True, False))
            for t, unf, dfr in runs:
                label = t + ("-unfused" if unf else "") + (" deferred" if dfr else "")
                progress(f"[rq-eval] ctx {ctx}: {label}")
                r = perplexity.run(model, text, label=label, ctx=ctx, chunks=chunks, cache_type=t, unfused=unf,
                                   deferred=dfr, kld_base=base_file, threads=threads)
                rows.append({"ctx": ctx, "unfused": unf, "deferred": dfr, "bits_per_value": bits.get(t), **r.as_dict()})
            base_file.unlink()
    return {"model": model.name, "text": text.name, "chunks": chunks, "seconds": round(time.time() - t0), "rows": rows}


def to_markdown(res: dict) -> str:
    def f(x, nd=4):
        return "–" if x is None else f"{x:.{nd}f}"

    lines = [f"## KV-cache quality: {res['model']}", "",
             f"Text {res['text']}, {res['chunks']} chunks per context; KLD against the F16-KV run of the same model.", "",
             "| ctx | cache | bits/value | PPL | ΔPPL | mean KLD | KLD p99 | same top-1 % | s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["ctx"]: r["ppl"] for r in res["rows"] if r["label"] == "f16"}
    for r in res["rows"]:
        lines.append(f"| {r['ctx']} | {r['label']} | {f(r.get('bits_per_value'), 3)} | {r['ppl']:.3f} | {r['ppl'] - base[r['ctx']]:+.3f} | {f(r['kld_mean'])} "
                     f"| {f(r['kld_p99'])} | {f(r['same_top_p'], 2)} | {r['seconds']:.0f} |")
    deferred = [r for r in res["rows"] if r.get("deferred")]
    if deferred:
        lines += ["", "Rows marked deferred ran with deferred prefill (LLAMA_KV_DEFERRED=1): llama-perplexity "
                  "scores every token as prefill, so they attend an exact F16 copy of their own K/V and their "
                  "KLD says nothing about the cache; decode-time quality: `rq-eval decode`."]
        plain = {(r["ctx"], r["label"]): r["kld_mean"] for r in res["rows"] if not r.get("deferred")}
        same = [r["label"] for r in deferred
                if r["kld_mean"] and plain.get((r["ctx"], r["label"].removesuffix(" deferred"))) == r["kld_mean"]]
        if same:
            lines += ["", f"**Deferred prefill had no effect** ({', '.join(sorted(set(same)))}: KLD identical to "
                      "the plain run): this build ignores LLAMA_KV_DEFERRED."]
    return "\n".join(lines) + "\n"
