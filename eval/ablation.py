"""The rotation ablation of the RotaryQuant paper (Table 8) and its "no inverse rotation" check.

Variants are research switches of the type (GGML_ISOQUANT_VARIANT, GGML_ISOQUANT_SKIP_INVERSE), read by
ggml in each llama-perplexity process: v3 = signs + WHT + SO(4) blocks (the type), v2 = SO(4) blocks
only, v1 = WHT + single-quaternion SO(3) blocks, none = no rotation; "v3, no inverse" leaves the
attention output in the rotated domain (wrong on purpose).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from rotaryquant.eval import perplexity

VARIANTS = (
    ("v3 (WHT+SO(4), the type)", {"GGML_ISOQUANT_VARIANT": "v3"}),
    ("v2 (SO(4) only)", {"GGML_ISOQUANT_VARIANT": "v2"}),
    ("v1 (WHT+SO(3))", {"GGML_ISOQUANT_VARIANT": "v1"}),
    ("none (no rotation)", {"GGML_ISOQUANT_VARIANT": "none"}),
    ("v3, no inverse rotation", {"GGML_ISOQUANT_VARIANT": "v3", "GGML_ISOQUANT_SKIP_INVERSE": "1"}),
)


def run(model: Path, text: Path, *, ctx: int = 512, chunks: int = 8, threads: int = 2, progress=print) -> dict:
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rq-abl-") as tmp:
        base_file = Path(tmp) / "base.kld"
        progress("[rq-eval ablation] f16 KV baseline")
        base = perplexity.run(model, text, label="f16", ctx=ctx, chunks=chunks, kld_base=base_file, save_base=True,
                              threads=threads)
        rows.append(base.as_dict())
        for label, env in VARIANTS:
            progress(f"[rq-eval ablation] {label}")
            r = perplexity.run(model, text, label=label, ctx=ctx, chunks=chunks, cache_type="isoquant3_0",
                               kld_base=base_file, threads=threads, env=env)
            rows.append(r.as_dict())
    return {"model": model.name, "ctx": ctx, "chunks": chunks, "seconds": round(time.time() - t0), "rows": rows}


def to_markdown(res: dict) -> str:
    base = res["rows"][0]["ppl"]
    lines = [f"## Rotation ablation (isoquant3_0 K and V): {res['model']}", "",
             f"ctx {res['ctx']}, {res['chunks']} chunks; KLD against f16 KV.", "",
             "| variant | PPL | ΔPPL | mean KLD | same top-1 % |", "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        k = "–" if r["kld_mean"] is None else f"{r['kld_mean']:.4f}"
        t = "–" if r["same_top_p"] is None else f"{r['same_top_p']:.2f}"
        lines.append(f"| {r['label']} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} | {k} | {t} |")
    return "\n".join(lines) + "\n"


def summary(res: dict) -> str:
    return "; ".join(f"{r['label'].split(' (')[0]}: PPL {r['ppl']:.2f}" for r in res["rows"])
