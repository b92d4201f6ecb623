"""rq-eval report: the JSON results in one markdown report, with plots and the claims ledger.

Every section renders from a results file when it exists (docs/results/*.json) and says so when it
does not, so a partial run still gives a report. Plots are PNGs next to the report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from rotaryquant import machine
from rotaryquant.eval import (ablation, alternatives, decode, frontier, kvbench, kvmemory, kvquality,
                              planverify, roofline, serve, versus_weights, weights)
from rotaryquant.eval import gate as gate_mod
from rotaryquant.eval import niah as niah_mod

CLAIMS = [
    # (source, claim, how we measure it, key into the measured values)
    ("RotaryQuant Tab. 3", "3-bit IsoQuant KV: ΔPPL ≤ +0.0012 vs FP16 KV at 2K context (Qwen3-30B-A3B)",
     "ΔPPL of isoquant3_0 KV vs f16 KV at the largest measured context", "iso_dppl"),
    ("RotaryQuant Tab. 3, K calibrated", "the same claim with our exact K centring / Q-K rebalancing "
     "(rq-calibrate; not in the paper: its fork keeps K in F16 during the prompt)",
     "ΔPPL/KLD of isoquant3_0 K+V with the model's K calibration vs f16 KV, largest measured context", "iso_calib_dppl"),
    ("RotaryQuant Tab. 3, both ways", "the same claim, measured as the paper did (deferred prefill: the prompt "
     "is kept in F16, so llama-perplexity never reads the compressed cache) and as users meet the cache (decode "
     "steps after a compressed prompt)",
     "KLD vs f16 KV: llama-perplexity with deferred prefill; rq-eval decode (M single-token steps after N)",
     "iso_both_ways"),
    ("RotaryQuant eq. 12", "deferred prefill holds a transient of 2·L·H_kv·d·T·2 bytes (F16 K/V of the prompt)",
     "transient rows in use (counter) and resident memory given back at the first decode step, vs eq. 12",
     "eq12"),
    ("RotaryQuant §4.4 / Tab. 6", "expert offloading: ~100× throughput penalty on expert misses",
     "decode t/s with the weights memory-mapped in a memory cgroup holding a fraction of a synthetic MoE "
     "(rq-plan --verify; contended 2-core VM, best of 3)", "paging"),
    ("RotaryQuant §3.2", "KV compressed 5.3× vs FP16 (48 bytes per 128 values)",
     "KV bytes per token, f16 / isoquant3_0 (our block also stores the fp16 norm: 50 bytes)", "kv_ratio"),
    ("RotaryQuant Tab. 9", "llama.cpp: fused −3.2% decode vs baseline; unfused −18% decode, −44% prompt",
     "decode and prompt t/s, isoquant3_0 fused / unfused, and fused / f16, deepest measured depth", "fused_ratio"),
    ("RotaryQuant Tab. 10", "fused decode: 0 dequantise calls, 0 fallbacks (3,612 steps)",
     "counters after fused decode on Gemma3-270M (tests/ggml/test_isoquant_llama.py)", "counters"),
    ("RotaryQuant App. F", "NIAH: 100% retrieval with 3-bit KV at 4K-32K, as uncompressed",
     "needles found, isoquant3_0 vs f16, per context", "niah"),
    ("RotaryQuant Tab. 8", "rotation ablation: v1 (SO(3)) 0/5, v2 (no WHT) 1/5, v3 5/5 gate; no inverse rotation PPL 7.05 → 15,369",
     "PPL/KLD per rotation variant and with the inverse rotation skipped", "ablation"),
    ("RotaryQuant Tab. 4", "12/12 quality gate with compressed KV", "gate passes per KV type", "gate"),
    ("RotaryQuant §5", "their MLX server under 8 clients: 4/8 empty bodies with HTTP 200, 34% parallel efficiency",
     "patched llama-server, 8 clients, isoquant3_0 and f16 KV", "serve"),
    ("RotaryQuant §4.3", "IsoQuant pays off when KV attention > 20% of decode time",
     "share of decode time that grows with depth (attention), from t/s at depths 0 and the deepest", "attn_share"),
    ("ITQ3_S abstract", "ITQ3_S reduces the PPL gap to FP16 by 57% vs IQ3_S", "ΔPPL/KLD of ITQ3_S vs IQ3_S, plain and calibrated: one role (same tensors) and whole files",
     "itq_gap"),
    ("ITQ3_S §6", "throughput > 1.5× the 4-bit alternatives (RTX 5090)", "CPU decode t/s ITQ3_S / Q4_K_M (no GPU here)", "itq_speed"),
]


def _itq_gap(w: dict, what: str) -> str | None:
    """ΔPPL and KLD of ITQ3_S against IQ3_S, plain and with calibration (the best calibrated ITQ3_S row
    against IQ3_S with an importance matrix), from one weights result."""
    rows = {r["label"].upper().replace("FFN_DOWN=", ""): r for r in w["rows"]}
    base = rows["F16"]["ppl"]

    def cmp(a: dict, b: dict) -> str:
        ga, gb = a["ppl"] - base, b["ppl"] - base
        kld = (f", KLD {a['kld_mean']:.3f} vs {b['kld_mean']:.3f}" if a.get("kld_mean") is not None
               and b.get("kld_mean") is not None else "")
        return (f"ΔPPL {ga:+.2f} vs {gb:+.2f} ({a['bpw']:.2f} vs {b['bpw']:.2f} bpw file-wide){kld}; gap "
                f"{'reduced' if abs(ga) < abs(gb) else 'increased'} by {abs(100 * (1 - abs(ga) / abs(gb))) if gb else float('nan'):.0f}%")

    out = []
    if "ITQ3_S" in rows and "IQ3_S" in rows:
        out.append(f"{what}: ITQ3_S vs IQ3_S {cmp(rows['ITQ3_S'], rows['IQ3_S'])}")
    cal = [r for k, r in rows.items() if k.startswith("ITQ3_S") and ("+CAL" in k or "+IMAT" in k)]
    # results before calib_tokens was recorded used another calibration per type (and ITQ3_S's v1 imatrix quantiser)
    if cal and "IQ3_S+IMAT" in rows and w.get("calib_tokens"):
        best = min(cal, key=lambda r: r.get("kld_mean") or r["ppl"])
        out.append(("" if out else f"{what}: ") + f"calibrated: {best['label']} vs IQ3_S+imat {cmp(best, rows['IQ3_S+IMAT'])}")
    return f"{'; '.join(out)}" if out else None


def _itq_speed(sp: dict) -> str | None:
    """Decode ITQ3_S / IQ3_S (and / Q3_K_S, Q4_K_M) from an interleaved ``rq-eval weight-speed`` result: the median
    of per-round ratios where the other file is the run's baseline, else the ratio of medians."""
    rows = [r for r in sp.get("rows") or [] if "OLD" not in str(r["file"]["name"]).upper()]
    by: dict[str, dict] = {}
    for r in rows:
        n = str(r["file"]["name"]).upper()
        for t in ("ITQ3_S", "IQ3_S", "Q3_K_S", "Q4_K_M"):
            if t in n and not (t == "IQ3_S" and "ITQ3_S" in n):
                by.setdefault(t, r)
    if "ITQ3_S" not in by or "IQ3_S" not in by:
        return None
    first = (sp.get("rows") or [None])[0]
    itq = by["ITQ3_S"]["tg"]

    def ratio(t: str) -> float:
        return itq["ratio"]["median"] if by[t] is first else itq["median"] / by[t]["tg"]["median"]

    parts = [f"{ratio(t):.2f}× {t}" for t in ("IQ3_S", "Q3_K_S", "Q4_K_M") if t in by]
    st = sp.get("settings") or {}
    how = ", ".join(f"{k} {st[k]}" for k in ("threads", "n_prompt", "n_gen", "rounds") if k in st)
    return "CPU decode ITQ3_S = " + ", ".join(parts) + f" (interleaved rounds; {how})"


def _load(results: Path, name: str) -> dict | list | None:
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _plot(path: Path, draw) -> str:
    import matplotlib  # lazy: optional (the eval extra), heavy; only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional (the eval extra), heavy; only the plots need it

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def _kv_speed_section(kvb: dict, out: Path, measured: dict) -> list[str]:
    rows = kvb["rows"]
    labels = sorted({r["label"] for r in rows})
    depths = sorted({r["depth"] for r in rows})

    def tps_vs_depth(ax):
        for lab in labels:
            pts = sorted((r["depth"], r["tg_tps"]) for r in rows if r["label"] == lab and r["tg_tps"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
        ax.set_xlabel("prefilled depth (tokens)")
        ax.set_ylabel("decode t/s")
        ax.set_title(f"decode speed vs depth ({kvb['model']})")
        ax.legend(fontsize=8)

    def fused_bars(ax):
        f = [next((r["tg_tps"] for r in rows if r["label"] == "isoquant3_0" and r["depth"] == d), 0) for d in depths]
        u = [next((r["tg_tps"] for r in rows if r["label"] == "isoquant3_0-unfused" and r["depth"] == d), 0) for d in depths]
        x = np.arange(len(depths))
        ax.bar(x - 0.2, f, 0.4, label="fused")
        ax.bar(x + 0.2, u, 0.4, label="unfused")
        ax.set_xticks(x, [str(d) for d in depths])
        ax.set_xlabel("prefilled depth (tokens)")
        ax.set_ylabel("decode t/s")
        ax.set_title("isoquant3_0: fused vs unfused decode")
        ax.legend(fontsize=8)

    p1 = _plot(out / "kv-tg-vs-depth.png", tps_vs_depth)
    p2 = _plot(out / "kv-fused-vs-unfused.png", fused_bars)
    deep = max(depths)
    iso = next((r for r in rows if r["label"] == "isoquant3_0" and r["depth"] == deep), None)
    f16 = next((r for r in rows if r["label"] == "f16" and r["depth"] == deep), None)
    if iso and f16:
        e = iso["extra"]
        measured["kv_ratio"] = f"{f16['kv_bytes_per_token'] / iso['kv_bytes_per_token']:.2f}×"
        measured["fused_ratio"] = (f"depth {deep}: fused/unfused decode {e.get('tg_fused_over_unfused', float('nan')):.2f}×, "
                                   f"prompt {e.get('pp_fused_over_unfused', float('nan')):.2f}×; fused/f16 decode "
                                   f"{e.get('tg_vs_f16', float('nan')):.2f}×")
        f0 = next((r for r in rows if r["label"] == "f16" and r["depth"] == 0), None)
        if f0 and f0["tg_tps"] and f16["tg_tps"]:
            # decode time per token = fixed (weights) + attention(depth); the growth from depth 0 is attention
            t0, td = 1.0 / f0["tg_tps"], 1.0 / f16["tg_tps"]
            measured["attn_share"] = f"f16 KV: {100 * (td - t0) / td:.0f}% of decode time at depth {deep} is depth-dependent"
    return ["## KV-cache speed and size", "", kvbench.to_markdown(kvb).split("\n", 2)[2], f"![]({p1})", "", f"![]({p2})", ""]


def _kv_quality_section(kvq: dict, out: Path, measured: dict, png: str = "kv-kld-vs-ctx.png") -> list[str]:
    rows = kvq["rows"]
    labels = [lab for lab in dict.fromkeys(r["label"] for r in rows) if lab != "f16"]

    def kld_vs_ctx(ax):
        for lab in labels:
            # log scale: deferred-prefill rows can be exactly 0
            pts = sorted((r["ctx"], r["kld_mean"]) for r in rows if r["label"] == lab and r["kld_mean"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("mean KLD vs f16 KV")
        ax.set_title(f"KV-cache KLD vs context ({kvq['model']})")
        ax.legend(fontsize=8)

    # one context: the table says it all
    p = _plot(out / png, kld_vs_ctx) if len({r["ctx"] for r in rows}) > 1 else None
    ctx = max(r["ctx"] for r in rows)
    base = next(r["ppl"] for r in rows if r["label"] == "f16" and r["ctx"] == ctx)
    for label, key in (("isoquant3_0", "iso_dppl"), ("isoquant3_0+calib", "iso_calib_dppl")):
        iso = next((r for r in rows if r["label"] == label and r["ctx"] == ctx), None)
        if iso:
            # several result files can hold the same row (one run per file): list it once
            seen = measured.get(key, "").split("; ") if measured.get(key) else []
            row = (f"{kvq['model']} ctx {ctx}: ΔPPL {iso['ppl'] - base:+.3f} (PPL {base:.2f} → {iso['ppl']:.2f}), "
                   f"KLD {iso['kld_mean']:.4f}")
            measured[key] = "; ".join(seen if row in seen else [*seen, row])
    return [kvquality.to_markdown(kvq), *([kvq["note"], ""] if kvq.get("note") else []), *([f"![]({p})"] if p else []), ""]


def _frontier_section(results: Path) -> list[str]:
    """Bits/value vs KLD vs needles, per model that has rows recording bits_per_value (eval/frontier.py)."""
    models = sorted({json.loads(f.read_text()).get("model") for f in results.glob("niah*.json")} - {None})
    out: list[str] = []
    for model in models:
        pts = frontier.collect(results, model)
        if sum(p.kld is not None for p in pts) < 2:
            continue
        png = _plot(results / f"kv-frontier-{Path(model).stem}.png", lambda ax, pts=pts, model=model: frontier.draw(ax, pts, model))
        out += [frontier.to_markdown(pts, model), f"![]({png})", ""]
    return out


def build(results: Path) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    measured: dict[str, str] = {}

    body: list[str] = alternatives.report_section(results)
    for f in sorted(results.glob("versus-weights*.json")):
        body += [versus_weights.to_markdown(json.loads(f.read_text())), f"Source: [{f.name}]({f.name}).", ""]
    kvb = _load(results, "kv-bench")
    body += _kv_speed_section(kvb, results, measured) if kvb else ["## KV-cache speed", "", "_not run: `rq-eval bench`_", ""]
    for f in sorted(results.glob("kv-bench-*.json")):  # further speed runs (e.g. with/without K calibration)

        body += [kvbench.to_markdown(json.loads(f.read_text())).replace("# KV-cache benchmark", "## KV-cache speed"), ""]
    for f in sorted(results.glob("roofline*.json")):  # rq-eval roofline: decode t/s against the bandwidth limit

        body += [roofline.to_markdown(json.loads(f.read_text())), f"Source: [{f.name}]({f.name}).", ""]
        if f.with_suffix(".png").exists():
            body += [f"![decode t/s vs depth with the predicted limit]({f.stem}.png)", ""]
    fa = results / "fa-decode-kernel.md"  # test-backend-ops perf of one attention op (curated, no JSON)
    if fa.exists():
        body += [fa.read_text().strip().replace("# ", "## ", 1), ""]
    kvq_files = sorted(results.glob("kv-quality*.json"))
    for f in kvq_files:
        body += _kv_quality_section(json.loads(f.read_text()), results, measured, png=f"{f.stem}-kld-vs-ctx.png")
    if not kvq_files:
        body += ["## KV-cache quality", "", "_not run: `rq-eval ppl`_", ""]

    decode_files = sorted(results.glob("decode*.json"))
    for f in decode_files:
        body += [decode.to_markdown(json.loads(f.read_text())), f"Source: [{f.name}]({f.name}).", ""]
    if not decode_files:
        body += ["## Decode-time KV quality", "", "_not run: `rq-eval decode`_", ""]
    # prefill runs against f16: rq-eval decode (full prompts, with rounds) or rq-eval bench (-p N at depth 0)
    for f in sorted(results.glob("prefill*.json")):
        res = json.loads(f.read_text())
        md = (kvbench.to_markdown(res).replace("# KV-cache benchmark", "## Prefill speed") if "kv_shape" in res
              else decode.to_markdown(res, title="Prefill speed (and decode-time KV quality)"))
        body += [md, f"Source: [{f.name}]({f.name}).", ""]

    for f in sorted(results.glob("kv-memory*.json")):
        mem = json.loads(f.read_text())
        body += [kvmemory.to_markdown(mem), ""]
        prev = measured.get("eq12", "")
        measured["eq12"] = (prev + "; " if prev else "") + f"{mem['model']}: " + ", ".join(
            f"T={r['prompt']} counter {r['counter_peak_mib']:.1f} = eq. 12 {r['eq12_mib']:.1f} MiB, released "
            f"{r['released_over_eq12']:.2f}×" for r in mem["rows"])

    both = []
    for f in kvq_files:
        kvq = json.loads(f.read_text())
        for r in kvq["rows"]:
            if r["label"].endswith(" deferred") and "isoquant3_0" in r["label"]:
                both.append(f"{kvq['model']} llama-perplexity ctx {r['ctx']} {r['label']}: KLD {abs(r['kld_mean']):.4f}")
    for f in decode_files:
        dec = json.loads(f.read_text())
        n_max = max(r["prefill"] for r in dec["rows"])
        for r in dec["rows"]:
            if r["cache"] in ("isoquant3_0", "isoquant3_0+calib") and r["prefill"] == n_max:
                both.append(f"{dec['model']} decode N={r['prefill']} {r['cache']}{' deferred' if r['deferred'] else ''}: "
                            f"KLD {r['kld_mean']:.4f} (step 0 {r['kld_step0']:.4f})")
    if both:
        measured["iso_both_ways"] = "; ".join(both)

    abl = _load(results, "ablation")
    if abl:
        body += [ablation.to_markdown(abl), ""]
        measured["ablation"] = ablation.summary(abl)
    else:
        body += ["## Rotation ablation", "", "_not run: `rq-eval ablation`_", ""]

    niah_files = sorted(results.glob("niah*.json"))
    by: dict[tuple[str, int], tuple[int, int]] = {}
    for nf in niah_files:
        niah = json.loads(nf.read_text())
        body += [niah_mod.to_markdown(niah), ""]
        for r in niah["rows"]:
            f, a = by.get((r["cache"], r["ctx"]), (0, 0))
            by[(r["cache"], r["ctx"])] = (f + r["found"], a + r["asked"])
    if by:
        measured["niah"] = "; ".join(f"{c} @{x}: {f}/{a}" for (c, x), (f, a) in sorted(by.items(), key=lambda k: (k[0][1], k[0][0])))
    else:
        body += ["## Needle in a haystack", "", "_not run: `rq-eval niah`_", ""]
    body += _frontier_section(results)

    gate_files = sorted(results.glob("gate*.json"))
    for f in gate_files:
        gate = json.loads(f.read_text())
        body += [gate_mod.to_markdown(gate), ""]
        prev = measured.get("gate", "")
        measured["gate"] = (prev + ", " if prev else "") + ", ".join(f"{g['cache']} {g['passed']}/{g['total']}" for g in gate)
    if not gate_files:
        body += ["## Quality gate", "", "_not run: `rq-eval gate`_", ""]

    sv = _load(results, "serve")
    if sv:
        body += [serve.to_markdown(sv), ""]
        measured["serve"] = "; ".join(f"{r['cache']}{' (deterministic)' if r.get('deterministic') else ''}: {r['failures']} failures, {r['empty']} empty, {r['mismatches']} differ "
                                      f"from alone, efficiency {r['parallel_efficiency']:.2f}" for r in sv)
    else:
        body += ["## llama-server under load", "", "_not run: `rq-eval serve`_", ""]
    for f in sorted(results.glob("serve-*.json")):  # further server runs (e.g. with deferred prefill)

        body += [serve.to_markdown(json.loads(f.read_text())), ""]

    pv = _load(results, "plan-verify")
    if pv:
        body += [planverify.to_markdown(pv), ""]
    else:
        body += ["## Memory plan vs measured", "", "_not run: `rq-plan --verify`_", ""]

    wfiles = [*sorted(results.glob("weights-tensor*.json")), *sorted(results.glob("weights-ftype*.json"))]
    gaps = []
    for f in wfiles:
        w = json.loads(f.read_text())
        mode = "tensor" if f.stem.startswith("weights-tensor") else "ftype"
        title = "llama-quantize types" if mode == "ftype" else "one tensor role per type, Q8_0 elsewhere"
        body += [weights.to_markdown(w, title), ""]
        gap = _itq_gap(w, "SmolLM2 ffn_down only" if mode == "tensor" else f"whole {w['model'].split('-instruct')[0]}")
        if gap:
            gaps.append(gap)
    if not wfiles:
        body += ["## Weights", "", "_not run: `rq-eval weights`_", ""]
    if gaps:
        measured["itq_gap"] = "; ".join(gaps)
    # the Vulkan backend on lavapipe (make test-vulkan's numbers, curated): correctness only, no JSON to render
    vk = results / "vulkan-lavapipe.md"
    body += ["## Vulkan backend (Mesa's lavapipe: correctness, not speed)", "",
             vk.read_text().strip() if vk.exists() else
             "_not run: `make test-vulkan` (scripts/ci/vulkan.sh)_", ""]
    # weight-speed-MODEL.json; the -before / -kernels runs document the kernel change, not the current state
    for f in [f for f in sorted(results.glob("weight-speed*.json")) if not f.stem.endswith(("-before", "-kernels"))]:
        sp = _itq_speed(json.loads(f.read_text()))
        if sp:
            measured["itq_speed"] = (measured.get("itq_speed", "") + "; " if "itq_speed" in measured else "") + sp

    if pv and pv.get("paging"):
        measured["paging"] = ", ".join(f"{r['slowdown']:.1f}× at {100 * r['fraction']:.0f}% of weights resident"
                                       for r in pv["paging"]["rows"] if r.get("fraction") and r.get("slowdown"))
    measured.setdefault("counters", "asserted by the test suite: fused decode dequantises 0 rows, fused calls > 0; "
                                    "unfused dequantises > 0")
    ledger = ["## Claims ledger", "", "| source | claim | what we measure | measured here |", "|---|---|---|---|"]
    for src, claim, how, key in CLAIMS:
        ledger.append(f"| {src} | {claim} | {how} | {measured.get(key, '_not measured yet_')} |")
    m = machine.describe()
    head = [
        "# RotaryQuant measurements",
        "",
        f"Generated by `rq-eval report` on {time.strftime('%Y-%m-%d')}, {m['arch']}, "
        f"{m['cpu']} ({m['cores']} cores), CPU only. The papers' numbers are claims; these are ours, on the small "
        "models the packages here ship (SmolLM2-135M, Gemma3-270M), each against its own F16.",
        "",
    ]
    out = results / "REPORT.md"
    out.write_text("\n".join(head + ledger + [""] + body))
    return out
