"""Multi-key needle in a haystack (the RotaryQuant paper's Appendix F).

Four random 7-digit numbers, each tied to a different key, are written into Shakespeare at a chosen
depth; the model is asked for each one in turn and scored exactly (the digits must appear in its
greedy answer). The haystack is evaluated once per (context, depth, cache type); each question
then runs from a saved copy of that state.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rotaryquant import kvtypes
from rotaryquant.bindings import type_from_name
from rotaryquant.bindings.accounting import kv_bits_or_none
from rotaryquant.errors import RQError

KEYS = ("blue lantern", "silver harbour", "green falcon", "amber gate", "copper bell", "quiet meadow",
        "iron compass", "velvet river")
N_NEEDLES = 8


class NiahError(RQError):
    """Bad arguments (context too large for the model, unknown cache type, ...)."""


@dataclass
class NiahResult:
    cache: str
    ctx: int
    depth: float
    found: int
    asked: int
    answers: list[str]
    seconds: float
    seed: int = 42
    bits_per_value: float | None = None


def needles(seed: int, n: int = N_NEEDLES) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(k, str(rng.randrange(1_000_000, 10_000_000))) for k in KEYS[:n]]


def haystack_offset(seed: int, text_len: int, ctx: int) -> int:
    """Where seed's haystack starts in the text (42: the start, as the first runs had it)."""
    room = max(text_len - 8 * ctx, 0)
    return 0 if seed == 42 or room == 0 else random.Random(seed * 7919).randrange(room) // 1000 * 1000


def build_prompt(llm, haystack_text: str, ctx: int, depth: float, pairs: list[tuple[str, str]],
                 reserve: int = 96) -> list[int]:
    """Token ids of a haystack of about ctx - reserve tokens with the needles at `depth`."""
    block = " ".join(f"The secret number of the {k} is {v}." for k, v in pairs)
    intro = "Read the text below and remember the secret numbers in it.\n\n"
    # ~4 characters per token: tokenise only what a ctx-token haystack can use
    toks_hay = llm.tokenize(haystack_text[: 8 * ctx].encode(), add_bos=False)
    toks_intro = llm.tokenize(intro.encode(), add_bos=True)
    toks_needle = llm.tokenize((" " + block + " ").encode(), add_bos=False)
    n_hay = ctx - reserve - len(toks_intro) - len(toks_needle)
    if n_hay < 64 or n_hay > len(toks_hay):
        raise NiahError(f"cannot build a {ctx}-token haystack from {len(toks_hay)} tokens of text")
    hay = toks_hay[:n_hay]
    cut = int(n_hay * depth)
    return toks_intro + hay[:cut] + toks_needle + hay[cut:]


def run(model: Path, haystack: Path, *, cache_types: list[str], ctxs: list[int], depths: list[float],
        seeds: tuple[int, ...] = (42,), n_needles: int = N_NEEDLES, deferred: str = "off", threads: int = 2,
        max_answer: int = 12, progress=print) -> dict:
    """Every (cache, context, seed, depth): one haystack prefill, then each needle asked from a saved copy of that
    state. Seeds change the numbers and where in the text the haystack starts. deferred "also" / "only": each
    non-f16 cache (also / only) runs with deferred prefill (label "TYPE deferred"): the haystack and each question
    are computed with exact F16 attention and written to the compressed cache; the answer's tokens read it."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    if not 1 <= n_needles <= len(KEYS):
        raise NiahError(f"{n_needles} needles asked for; give 1 to {len(KEYS)}")
    if deferred not in ("off", "also", "only"):
        raise NiahError(f"deferred={deferred!r}: give off, also or only")
    text = haystack.read_text(errors="replace")
    results: list[NiahResult] = []
    bits = kv_bits_or_none(model, cache_types, max(ctxs), progress)
    modes = {"off": (False,), "also": (False, True), "only": (True,)}[deferred]
    runs = [(c, d) for c in cache_types for d in ((False,) if c == "f16" else modes)]
    for cache, dfr in runs:
        label = cache + (" deferred" if dfr else "")
        tk, tv = (type_from_name(x) for x in kvtypes.split(cache))
        for ctx in ctxs:
            llm = llama_cpp.Llama(model_path=str(model), n_ctx=ctx, n_batch=512, n_threads=threads, seed=seeds[0],
                                  flash_attn=True, type_k=tk, type_v=tv, verbose=False,
                                  k_center=kvtypes.k_center(cache), kv_layer_types=kvtypes.layer_types(cache),
                                  kv_window=kvtypes.window(cache), kv_deferred=dfr)
            limit = llama_cpp.llama_model_n_ctx_train(llm.model)
            if ctx > limit:
                raise NiahError(f"context {ctx} is larger than the model's training context {limit}")
            for seed, depth in ((s, d) for s in seeds for d in depths):
                t0 = time.time()
                pairs = needles(seed, n_needles)
                progress(f"[rq-eval niah] {label} ctx {ctx} seed {seed} depth {depth:.0%}")
                prompt = build_prompt(llm, text[haystack_offset(seed, len(text), ctx):], ctx, depth, pairs)
                llm.reset()
                llm.eval(prompt)
                state = llm.save_state()
                found, answers = 0, []
                for key, value in pairs:
                    llm.load_state(state)
                    q = llm.tokenize(f"\n\nQuestion: What is the secret number of the {key}?\n"
                                     f"Answer: The secret number of the {key} is".encode(), add_bos=False)
                    llm.eval(q)
                    out = []
                    for _ in range(max_answer):
                        tok = llm.sample(temp=0.0)
                        if tok == llm.token_eos():
                            break
                        out.append(tok)
                        llm.eval([tok])
                    ans = llm.detokenize(out).decode(errors="replace")
                    answers.append(ans.strip())
                    found += value in ans.replace(",", "").replace(" ", "")
                results.append(NiahResult(label, ctx, depth, found, len(pairs), answers, round(time.time() - t0, 1),
                                          seed, None if cache not in bits else round(bits[cache], 3)))
            del llm
    return {"model": model.name, "seeds": list(seeds), "needles": {s: needles(s, n_needles) for s in seeds},
            "rows": [asdict(r) for r in results]}


def to_markdown(res: dict) -> str:
    depths = sorted({r["depth"] for r in res["rows"]})
    seeds = res.get("seeds", [res.get("seed", 42)])
    n = len(next(iter(res["needles"].values()))) if isinstance(res["needles"], dict) else len(res["needles"])
    lines = [f"## Needle in a haystack: {res['model']}", "",
             f"{n} numeric needles per haystack, seeds {', '.join(map(str, seeds))} (numbers and haystack start), "
             "at each depth; found / asked over the seeds, greedy.", "",
             "| cache | bits/value | ctx | " + " | ".join(f"depth {d:.0%}" for d in depths) + " | total |",
             "|---|---:|---:|" + "---:|" * (len(depths) + 1)]
    keys = sorted({(r["cache"], r["ctx"]) for r in res["rows"]}, key=lambda k: (k[1], k[0]))
    for cache, ctx in keys:
        rows = [x for x in res["rows"] if x["cache"] == cache and x["ctx"] == ctx]
        cells = []
        for d in depths:
            at = [x for x in rows if x["depth"] == d]
            cells.append(f"{sum(x['found'] for x in at)}/{sum(x['asked'] for x in at)}")
        total = f"{sum(x['found'] for x in rows)}/{sum(x['asked'] for x in rows)}"
        bpv = rows[0].get("bits_per_value")
        lines.append(f"| {cache} | {'–' if bpv is None else f'{bpv:.3f}'} | {ctx} | " + " | ".join(cells) + f" | {total} |")
    return "\n".join(lines) + "\n"
