"""Markdown of an `rq-eval versus` result (rotaryquant.eval.versus): the builds, one table per measurement, what
each build's log said about its cache, and the runs that did not complete."""

from __future__ import annotations

from collections.abc import Sequence

from rotaryquant.eval.versus import MEASURES


def _f(x: float | None, nd: int = 4) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _bits(r: dict) -> str:
    return _f(r.get("bits_per_value"), 3)


def to_markdown(res: dict) -> str:
    lines = [f"## Beside the alternatives: {res['model']}", "",
             f"Text {res['text']}; {res['threads']} threads. Builds (each measured through its own binaries and "
             "libllama; every row against the same build's F16 run):", "",
             "| build | commit | CPU flags |", "|---|---|---|"]
    for b in res["builds"].values():
        cm = b.get("cmake", {})
        flags = ", ".join(k.removeprefix("GGML_") for k in ("GGML_NATIVE", "GGML_AVX2", "GGML_AVX512", "GGML_FMA",
                                                             "GGML_F16C") if cm.get(k) == "ON") or "–"
        lines.append(f"| {b['name']} | {(b.get('commit') or '–')[:12]} | {flags} |")
    failed = []
    for m in MEASURES:
        rows = res.get(m)
        if not rows:
            continue
        lines += ["", _TITLES[m](res), ""] + _TABLES[m](rows)
        failed += [r for r in rows if "error" in r]
    notes = {(r["build"], n) for m in MEASURES for r in res.get(m) or [] for n in r.get("notes", [])}
    if notes:
        lines += ["", "What the builds' logs said about their caches:", ""]
        lines += [f"- {b}: {n}" for b, n in sorted(notes)]
    if failed:
        lines += ["", "Runs that did not complete (exactly what happened):", ""]
        seen = set()
        for r in failed:
            if r["config"] in seen:
                continue
            seen.add(r["config"])
            lines.append(f"- `{r['config']}`: {r['error']}: {(r.get('log_tail') or [''])[0]}")
    return "\n".join(lines) + "\n"


def _title_kld(res: dict) -> str:
    r = res["kld"][0]
    return (f"### Prefill quality: llama-perplexity at context {r['ctx']}, {r['chunks']} chunks, --kl-divergence "
            "against the build's F16")


def _columns(rows: list[dict], cols: Sequence[tuple[str, str, int]]) -> list[str]:
    """A table of rows: configuration, bits/value, then (header, key, digits) per column; a row that did not run
    says so in its first column."""
    out = ["| configuration | bits/value | " + " | ".join(h for h, _, _ in cols) + " |",
           "|---|---:|" + "---:|" * len(cols)]
    for r in rows:
        cells = ([f"did not run ({r['error']})"] + [""] * (len(cols) - 1) if "error" in r
                 else [_f(r.get(k), nd) for _, k, nd in cols])
        label = r["config"] + (f" ({r['fill']} fill)" if r.get("fill") else "")
        out.append(f"| {label} | {_bits(r)} | " + " | ".join(cells) + " |")
    return out


def _rows_kld(rows: list[dict]) -> list[str]:
    return _columns(rows, [("PPL", "ppl", 3), ("mean KLD", "kld_mean", 5), ("KLD p99", "kld_p99", 4),
                           ("same top-1 %", "same_top_p", 2)])


def _title_decode(res: dict) -> str:
    r = res["decode"][0]
    rounds = len(next((x["decode_tps_rounds"] for x in res["decode"] if x.get("decode_tps_rounds")), [0]))
    reps = max((len(x) for r in res["decode"] for x in r.get("decode_tps_repeats") or []), default=1)
    again = f", the steps timed {reps} times after each prefill (state restored)" if reps > 1 else ""
    fill = (". Rows marked independent fill: each 512-token call of the prompt attended only to itself (rq-probe "
            "--fill independent; the same cells and positions for the steps, other values: speeds only, and their "
            "prefill t/s are not a prompt's)" if any(x.get("fill") for x in res["decode"]) else "")
    return (f"### Decode after a {r['prefill']}-token prompt: rq-probe, {r['steps']} teacher-forced steps; speeds are "
            f"medians of {rounds} interleaved round(s){again}, ratios over the same build's F16{fill}")


def _rows_decode(rows: list[dict]) -> list[str]:
    # a call-by-call fill's rate is not a prompt's prefill rate: not shown
    rows = [{k: v for k, v in r.items() if not (r.get("fill") and k.startswith("prefill_tps"))} for r in rows]
    return _columns(rows, [("decode KLD", "kld_mean", 5), ("p99", "kld_p99", 4), ("same top-1 %", "same_top1_pct", 1),
                           ("prefill t/s", "prefill_tps", 1), ("× f16", "prefill_tps_vs_f16", 2),
                           ("decode t/s", "decode_tps", 2), ("× f16", "decode_tps_vs_f16", 2)])


def _title_ttft(res: dict) -> str:
    r = res["ttft"][0]
    return (f"### Start-up: seconds from process start to the first token of a {r['prompt']}-token prompt (rq-probe; "
            "model load, context creation, the prompt), medians")


def _rows_ttft(rows: list[dict]) -> list[str]:
    return _columns(rows, [("first token s", "first_token_s", 2), ("context creation s", "ctx_s", 2),
                           ("added over the build's F16 s", "added_s", 2),
                           ("next start: first token s", "first_token_kept_s", 2),
                           ("next start: added s", "added_kept_s", 2)])


def _title_niah(res: dict) -> str:
    n = sorted({r["asked"] for r in res["niah"]})
    keys = str(n[0]) if len(n) == 1 else f"{n[0]}-{n[-1]}"
    return f"### Needles: {keys} keys per haystack, greedy answers; found / asked over depths and seeds"


def _rows_niah(rows: list[dict]) -> list[str]:
    ctxs = sorted({r["ctx"] for r in rows})
    out = ["| configuration | bits/value | " + " | ".join(f"ctx {c}" for c in ctxs) + " |",
           "|---|---:|" + "---:|" * len(ctxs)]
    for cfg in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == cfg]
        cells = []
        for c in ctxs:
            at = [r for r in mine if r["ctx"] == c]
            bad = [r for r in at if "error" in r]
            cells.append("–" if not at else f"did not run ({bad[0]['error']})" if bad else
                         f"{sum(r['found'] for r in at)}/{sum(r['asked'] for r in at)}")
        # the default per-layer types depend on the context: its bits, one per context where they differ
        bits = dict.fromkeys(_bits(next(r for r in mine if r["ctx"] == c)) for c in ctxs if any(r["ctx"] == c for r in mine))
        out.append(f"| {cfg} | {' / '.join(bits)} | " + " | ".join(cells) + " |")
    return out


_TITLES = {"kld": _title_kld, "decode": _title_decode, "ttft": _title_ttft, "niah": _title_niah}
_TABLES = {"kld": _rows_kld, "decode": _rows_decode, "ttft": _rows_ttft, "niah": _rows_niah}
