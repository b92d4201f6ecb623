"""Beside the alternatives, summarised: docs/results/versus-*.json (rq-eval versus, versus-weights) per model and
configuration, as REPORT.md's full section and README's short table, with the verdicts they state checked.

Standard library only: scripts/readme_table.py loads this file without the virtual environment.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

MODELS = {"gemma-3-270m-q4_k_m.gguf": "Gemma3-270M", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": "Qwen2.5-Coder-1.5B",
          "SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M"}
OURS = "ours:isoquant3_0"  # our default cache: -ctk isoquant3_0 -ctv isoquant3_0 and nothing else
BUDGET = 4.5  # the peers' recommended configurations compared here: at most this many bits per value
KLD_CTX = 2048
DEPTH = 8192

# (model file, peer configuration, measure) where ours (defaults) loses a verdict below: the measured cause, and our
# configuration that answers it at no more bits than the peer's (checked: it must beat the peer on that measure). The
# long form is in docs/NOTES.md, "Beside the alternatives". The tables mark the row; a loss not listed here stops the
# generator.
UNCENTRED = ("a bit more per value, and SmolLM2's keys carry no constant worth centring: at the same bits, uncentred, "
             "ours is lower", "ours:isoquant4_0 --no-k-center")
KNOWN_GAPS: dict[tuple[str, str, str], tuple[str, str]] = {
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "ik:iq4_nl -khad -vhad", "kld"): UNCENTRED,
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "ik:q4_0 -khad -vhad", "kld"): UNCENTRED,
}


def _known(model: str, label: str) -> list[str]:
    return [m for (f, p, m) in KNOWN_GAPS if (f, p) == (model, label)]


def _gap_labels(model: str, measure: str) -> list[str]:
    return [p for (f, p, m) in KNOWN_GAPS if (f, m) == (model, measure)]


def _what(measure: str) -> str:
    return f"2K KLD (context {KLD_CTX})" if measure == "kld" else f"decode KLD after {DEPTH // 1024}K"


class VerdictError(ValueError):
    """A stated verdict no longer holds on the results: rewrite it (or find out why) before regenerating."""


def holds(cond: bool, verdict: str) -> str:
    if not cond:
        raise VerdictError(f"the verdict {verdict!r} no longer holds on docs/results: see eval/alternatives.py")
    return verdict


def load(results: Path) -> dict[str, dict[str, dict]]:
    """model -> configuration label -> {"kld": row, "decode": {prefill: row}, "ttft": row, "niah": {ctx: [rows]},
    "build": build description}. Later files (by name) override earlier ones row by row; every file's decode row is
    also kept under "decode_runs": {prefill: {source: row}} (speeds are set side by side within one run only), the
    source a file name, with "#independent" for its rows of a cache filled call by call."""
    out: dict[str, dict[str, dict]] = {}
    for f in sorted(results.glob("versus-*.json")):
        if f.name.startswith("versus-weights"):
            continue
        res = json.loads(f.read_text())
        model = out.setdefault(res["model"], {})
        for m in ("kld", "decode", "ttft", "niah"):
            for r in res.get(m) or []:
                c = model.setdefault(r["config"], {"build": res["builds"].get(r["build"], {"name": r["build"]}),
                                                   "decode": {}, "decode_runs": {}, "niah": {}, "files": set()})
                c["files"].add(f.name)
                if m == "decode":  # a prefill just under DEPTH (a model's 8K context less the decode steps) is its 8K row
                    n = DEPTH if 0.95 * DEPTH <= r["prefill"] <= DEPTH else r["prefill"]
                    # a cache filled call by call (fill "independent") has a row of its own in that run; it stands
                    # for its configuration's speed at that depth only where no prompt-filled row does
                    src = f.name + (f"#{r['fill']}" if r.get("fill") else "")
                    row = c["decode_runs"].setdefault(n, {})[src] = {**r, "source": src}
                    if "fill" not in row or "fill" in c["decode"].get(n, {"fill": None}):
                        c["decode"][n] = row
                elif m == "niah":
                    c["niah"].setdefault(r["ctx"], []).append(r)
                else:
                    c[m] = r
    return out


def within(b: float | None) -> bool:
    """At most BUDGET bits per value, as logged (4.501: q4_0's 4.5 read from MiB printed to two decimals)."""
    return b is not None and b <= BUDGET + 0.01


def _f(x: float | None, nd: int = 4) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def bits(c: dict) -> float | None:
    """Bits per value as the build logged them at the 2K KLD run (else the 8K decode run)."""
    r = c.get("kld") or c["decode"].get(DEPTH) or {}
    return r.get("bits_per_value")


def needles(c: dict, ctx: int) -> str:
    rows = c["niah"].get(ctx) or []
    if not rows:
        return "–"
    if any("error" in r for r in rows):
        return f"did not run ({next(r for r in rows if 'error' in r)['error']})"
    return f"{sum(r['found'] for r in rows)}/{sum(r['asked'] for r in rows)}"


def _cell_decode(c: dict, n: int, key: str, nd: int = 2) -> str:
    r = c["decode"].get(n)
    if r is None:
        return "–"
    if "error" in r:
        return "did not run" if "timed out" not in " ".join(r.get("log_tail", [])) else "timed out"
    return _f(r.get(key), nd)


def attention_slope(c: dict, n: int) -> float | None:
    """Decode milliseconds per token added by each 1024 keys between DEPTH and n: the cache's own cost per key,
    without the weights' (which every depth pays alike, and where builds differ most)."""
    a, b = c["decode"].get(DEPTH), c["decode"].get(n)
    if not a or not b or "error" in a or "error" in b or not a.get("decode_tps") or not b.get("decode_tps"):
        return None
    return (1000 / b["decode_tps"] - 1000 / a["decode_tps"]) / ((b["prefill"] - a["prefill"]) / 1024)


def model_table(model: str, configs: dict[str, dict]) -> list[str]:
    depths = sorted({n for c in configs.values() for n in c["decode"] if n > DEPTH})
    head = ("| configuration | bits/value | 2K KLD | p99 | same top-1 % | decode KLD after 8K | p99 | prefill 8K × f16 "
            "| decode 8K × f16 | decode 8K t/s | first token s (added) | needles 8K | needles 16K |"
            + "".join(f" decode KLD after {round(n / 1024)}K | decode {round(n / 1024)}K t/s | ms per token per 1K keys |"
                      for n in depths))
    lines = [f"### {MODELS.get(model, model)}", "", head, "|---|" + "---:|" * (head.count("|") - 2)]
    for label, c in configs.items():
        k, t = c.get("kld") or {}, c.get("ttft") or {}
        if "error" in k:
            q = f"did not run ({k['error']}) | | "
        else:
            q = f"{_f(k.get('kld_mean'))} | {_f(k.get('kld_p99'), 3)} | {_f(k.get('same_top_p'), 1)}"
        tt = "–" if not t else "did not run" if "error" in t else f"{t['first_token_s']:.2f} ({t.get('added_s', 0):+.2f})"
        row = (f"| {label}{' ³' if _known(model, label) else ''} | {_f(bits(c), 2)} | {q} "
               f"| {_cell_decode(c, DEPTH, 'kld_mean', 4)} | {_cell_decode(c, DEPTH, 'kld_p99', 3)} "
               f"| {_cell_decode(c, DEPTH, 'prefill_tps_vs_f16')} | {_cell_decode(c, DEPTH, 'decode_tps_vs_f16')} "
               f"| {_cell_decode(c, DEPTH, 'decode_tps', 1)} | {tt} | {needles(c, 8192)} | {needles(c, 16384)} |")
        row += "".join(f" {_cell_decode(c, n, 'kld_mean', 4)} | {_cell_decode(c, n, 'decode_tps', 2)}"
                       f"{' ⁱ' if 'fill' in c['decode'][n] else ''} | {_f(attention_slope(c, n), 3)} |"
                       if n in c["decode"] else " – | – | – |" for n in depths)
        lines.append(row)
    return lines


def _gap_answer(configs: dict[str, dict], model: str, labels: list[str], measure: str) -> str:
    """Known gaps on one model and measure in words, with our answering row's numbers: checked to beat each peer at
    no more bits than that peer's."""
    answers: dict[tuple[str, str], list[str]] = {}
    for label in labels:
        answers.setdefault(KNOWN_GAPS[(model, label, measure)], []).append(label)
    parts = []
    for (why, answer), peers in sorted(answers.items()):
        ours = configs.get(answer)
        ok = _value(ours, measure, "kld_mean")
        for label in peers:
            peer = configs.get(label)
            pk = _value(peer, measure, "kld_mean")
            holds(pk is not None and ok is not None and ok < pk and bits(ours) <= bits(peer) + 0.02,
                  f"{answer} beats {label} on {model} ({measure}) at no more bits")
        parts.append(f"{why}: {answer} {ok:.4f} at {bits(ours):.2f} bits")
    return "; ".join(parts)


def _cpu_kind(cpu: dict | None, mixed: bool) -> str:
    if not cpu:
        return "CPU not recorded (runs before it was: the machine varied by day, with and without AVX-512)"
    if mixed:
        return "rows from more than one CPU"
    if cpu.get("avx512_vnni_bf16"):
        return f"{cpu.get('model') or 'a CPU'} with AVX-512 VNNI/BF16: AVX-512 kernels"
    return f"{cpu.get('model') or 'a CPU'} without AVX-512 VNNI/BF16: float AVX2 kernels"


def kernels_note(results: Path) -> str:
    """Which of our IsoQuant attention kernels each file's rows ran, from the CPU its run recorded: AVX-512 (VNNI, BF16)
    where the CPU has them, the float AVX2 ones otherwise. Files from before runs recorded the CPU say so: the
    machine varied by day."""
    kinds: dict[str, list[str]] = {}
    for f in sorted(results.glob("versus-*.json")):
        if f.name.startswith("versus-weights"):
            continue
        res = json.loads(f.read_text())
        kinds.setdefault(_cpu_kind(res.get("cpu"), bool(res.get("cpu_mixed"))), []).append(f.name)
    return ("Our IsoQuant attention kernels take AVX-512 at run time where the CPU has VNNI and BF16, float AVX2 "
            "kernels elsewhere; everything else in every build is AVX2 code. The CPU of each run: "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items()) + ".")


def fill_note(data: dict) -> list[str]:
    """The footnote of rows whose cache was filled call by call: what that fill changes, from the configurations a run
    measured both ways (decode t/s over the prompt-filled row's, same file)."""
    if not any("fill" in r for cs in data.values() for c in cs.values() for r in c["decode"].values()):
        return []
    pairs = [f"{_short(m)} {label} at {round(n / 1024)}K {r['decode_tps'] / p['decode_tps']:.2f}×"
             for m, cs in data.items() for label, c in cs.items() for n, by in (c.get("decode_runs") or {}).items()
             for src, r in by.items() if "#" in src and r.get("decode_tps")
             and (p := by.get(src.split("#")[0])) and p.get("decode_tps")]
    return [("ⁱ decode t/s after a cache filled call by call (`rq-eval versus --fill independent`): each 512-token "
             "call of the prompt attends only to itself, so the steps see the same cells at the same positions "
             "without the prompt's hours of attention; the values cached differ, so no KLD. "
             + ("Decode t/s so filled over the same configuration's prompt-filled run, both in one run: "
                + ", ".join(pairs) + "." if pairs else "Not yet checked against a prompt-filled run.")), ""]


def report_section(results: Path) -> list[str]:
    """REPORT.md's "Against the alternatives": every configuration of every model, the builds, what their logs said,
    the runs that did not complete, the verdicts."""
    data = load(results)
    if not data:
        return []
    lines = ["## Against the alternatives", "",
             "Stock llama.cpp, the TurboQuant fork and ik_llama.cpp beside ours, each through its own binaries (its own "
             "llama-perplexity; rq-probe compiled against its own libllama for decode, start-up and needles), each row "
             "against the same build's F16 cache, 2 threads, this machine. Bits per value from the cache size each "
             "build logged (2K KLD run). How: [docs/alternatives.md](../alternatives.md).", ""]
    try:
        lines += ["Verdicts (checked by the generator):", ""] + [f"- {v}" for v in all_verdicts(data, results)] + [""]
    except VerdictError as e:
        lines += [f"**A verdict stopped holding**: {e}", ""]
    builds: dict[str, dict] = {}
    for model, configs in data.items():
        lines += model_table(model, configs) + [""]
        for c in configs.values():
            builds.setdefault(c["build"]["name"], c["build"])
    lines += fill_note(data)
    gaps = sorted({(m, measure) for m, _, measure in KNOWN_GAPS if m in data})
    if gaps:
        lines += ["³ a peer row below our default's KLD: " + "; ".join(
            f"{MODELS.get(m, m)}, {_what(measure)}: {_gap_answer(data[m], m, _gap_labels(m, measure), measure)}"
            for m, measure in gaps), ""]
    lines += ["Builds:", "", "| build | commit | CPU options (CMake cache) |", "|---|---|---|"]
    for name, b in builds.items():
        cm = b.get("cmake", {})
        opts = ", ".join(f"{k.removeprefix('GGML_')}={v}" for k, v in cm.items() if k.startswith("GGML_")
                         and k[5:] in ("NATIVE", "AVX", "AVX2", "AVX512", "FMA", "F16C", "BMI2", "OPENMP"))
        lines.append(f"| {name} | {b.get('commit') or '–'} | {opts or '–'} |")
    lines += ["", kernels_note(results), ""]
    notes = sorted({(c["build"]["name"], n.strip(" =")) for cs in data.values() for c in cs.values()
                    for r in [c.get("kld") or {}, *c["decode"].values()] for n in r.get("notes", [])
                    if not n.rstrip().endswith("_hadam = 0")})
    if notes:
        lines += ["What the builds' logs said about their caches:", ""] + [f"- {b}: {n}" for b, n in notes] + [""]
    failed = sorted({(m, label, r["error"], (r.get("log_tail") or [""])[0]) for m, cs in data.items()
                     for label, c in cs.items() for r in [c.get("kld") or {}, *c["decode"].values()] if "error" in r})
    if failed:
        lines += ["Runs that did not complete:", ""]
        lines += [f"- {MODELS.get(m, m)}, `{label}`: {e}: {why}" for m, label, e, why in failed] + [""]
    files = sorted({f for cs in data.values() for c in cs.values() for f in c["files"]})
    lines += ["Sources (each row's exact command is in its file): " + ", ".join(f"[{f}]({f})" for f in files), ""]
    return lines


# --- the verdicts ---------------------------------------------------------------------------------------------


def _peers(configs: dict[str, dict]) -> list[tuple[str, dict]]:
    return [(label, c) for label, c in configs.items() if not label.startswith("ours:") and not label.endswith(":f16")]


def _short(model: str) -> str:
    return MODELS.get(model, model).split("-")[0]


def _value(c: dict | None, measure: str, key: str) -> float | None:
    """A configuration's number: kld (the 2K run), decode (after DEPTH), ttft; None where it did not run."""
    if not c:
        return None
    r = c["decode"].get(DEPTH) if measure == "decode" else c.get(measure)
    return None if not r or "error" in r else r.get(key)


def _quality(data: dict, measure: str, what: str) -> str | None:
    """One checked line: ours (defaults) below every peer configuration at <= BUDGET bits, on every model, but for
    the KNOWN_GAPS, which the line names with the configuration of ours that answers each."""
    parts, gaps, ok = [], [], True
    for model, configs in data.items():
        ov = _value(configs.get(OURS), measure, "kld_mean")
        # ours as that run logged it: the default's per-layer types, hence its bits, change with the context
        ob = _value(configs.get(OURS), measure, "bits_per_value") or (bits(configs[OURS]) if OURS in configs else None)
        if ov is None or ob is None:
            continue
        peers = [(label, v, bits(c)) for label, c in _peers(configs)
                 if (v := _value(c, measure, "kld_mean")) is not None and within(bits(c))]
        rivals = [p for p in peers if (model, p[0], measure) not in KNOWN_GAPS]
        known = [p for p in peers if (model, p[0], measure) in KNOWN_GAPS and p[1] <= ov]
        ok &= all(ov < v for _, v, _ in rivals)
        best = min(rivals, key=lambda p: p[1]) if rivals else None
        parts.append(f"{_short(model)} {ov:.4f} at {ob:.2f} bits vs "
                     + (f"{best[1]:.4f} ({best[0]}, {best[2]:.2f})" if best else "no peer but the exceptions"))
        if known:
            gaps.append(f"{_short(model)} " + ", ".join(f"{label} {v:.4f}" for label, v, _ in known)
                        + f" at {max(b for _, _, b in known):.2f} bits "
                        + f"({_gap_answer(configs, model, [p[0] for p in known], measure)})")
    if not parts:
        return None
    return holds(ok, f"{what}: ours lower than every peer cache at ≤ {BUDGET} bits/value (ours vs the best peer): "
                     + "; ".join(parts) + ("; except " + ", ".join(gaps) if gaps else ""))


NEXT_START_S = 0.5  # what a later start of ours may add over its F16 start, K statistics kept from the first


def _start_up(data: dict) -> str | None:
    """Start-up on a file without calibration: ours measures K statistics at its first start (the peers measure
    nothing) and keeps them, so a later start adds at most NEXT_START_S over its F16 start."""
    parts, ok = [], True
    for model, configs in data.items():
        ours = _value(configs.get(OURS), "ttft", "added_s")
        later = _value(configs.get(OURS), "ttft", "added_kept_s")
        peers = [v for _, c in _peers(configs) if (v := _value(c, "ttft", "added_s")) is not None]
        if ours is None or not peers:
            continue
        ok &= ours > max(peers) and (later is None or later <= NEXT_START_S)
        nxt = f", later starts {later:+.2f} s" if later is not None else ", every start"
        parts.append(f"{_short(model)} first start +{ours:.1f} s{nxt} (peers at most {max(peers):+.2f} s)")
    if not parts:
        return None
    return holds(ok, "start-up on a file without calibration: ours measures K statistics once per model file and "
                     "keeps them, which the first start pays: " + "; ".join(parts) + " to the first token")


def _needles(data: dict, ctxs: tuple[int, ...] = (DEPTH, 2 * DEPTH)) -> str | None:
    """Multi-key needles at each context: ours (defaults) finds at least as many as every peer cache at <= BUDGET
    bits, counted over the haystacks (seed, depth) both measured; one line over the contexts that have peer rows."""
    parts, done, ok = [], [], True
    for ctx in ctxs:
        for model, configs in data.items():
            def hays(c: dict | None, ctx: int = ctx) -> dict[tuple, dict] | None:
                rows = (c or {"niah": {}})["niah"].get(ctx) or []
                if not rows or any("error" in r for r in rows):
                    return None
                return {(r.get("seed"), r.get("depth")): r for r in rows}
            ours = hays(configs.get(OURS))
            peers = [(label, h) for label, c in _peers(configs) if within(bits(c)) and (h := hays(c))]
            if ours is None or not peers:
                continue
            cells = []
            for label, h in peers:
                same = [k for k in h if k in ours]
                if not same:
                    continue
                mine, theirs = (sum(x[k]["found"] for k in same) for x in (ours, h))
                asked = sum(h[k]["asked"] for k in same)
                ok &= mine >= theirs
                n = len(same)
                cells.append(f"{label} {theirs}/{asked}" + ("" if n == len(ours) else
                             f" (ours {mine}/{asked} on the same {f'{n} haystacks' if n > 1 else 'haystack'})"))
            if not cells:
                continue
            done.append(ctx)
            parts.append(f"{_short(model)} at {ctx // 1024}K {sum(r['found'] for r in ours.values())}/"
                         f"{sum(r['asked'] for r in ours.values())}; " + ", ".join(cells))
    if not parts:
        return None
    at = " and ".join(f"{c // 1024}K" for c in dict.fromkeys(done))
    return holds(ok, f"needles at {at} (multi-key, greedy): ours at least as many as every peer cache at "
                     f"≤ {BUDGET} bits/value: " + "; ".join(parts))


def _speed(data: dict) -> str | None:
    """Decode after DEPTH tokens: ours and the fastest peer cache at <= BUDGET bits, each over its own build's f16 in
    the same run (the ratio: rows re-measured on another day keep it, their t/s move with the machine), t/s beside."""
    parts = []
    for model, configs in data.items():
        ratio, tps = _value(configs.get(OURS), "decode", "decode_tps_vs_f16"), _value(configs.get(OURS), "decode",
                                                                                         "decode_tps")
        peers = [(label, r, _value(c, "decode", "decode_tps")) for label, c in _peers(configs) if within(bits(c))
                 and (r := _value(c, "decode", "decode_tps_vs_f16")) is not None]
        if ratio is None or not peers:
            continue
        fast = max(peers, key=lambda p: p[1])
        parts.append(f"{_short(model)} {ratio:.2f}× its f16 ({tps:.1f} t/s); fastest peer {fast[0]} {fast[1]:.2f}× "
                     f"its f16 ({fast[2]:.1f} t/s)")
    return ("decode after an 8K prompt, over each build's own f16 (t/s from the day each row was run): "
            + "; ".join(parts)) if parts else None


# (model file, peer configuration) whose decode after a long prompt is faster than ours in t/s: the measured cause.
# Checked: the peer build's own f16 is faster than ours in the same run and ours gains at least as much over its f16
# as the peer's cache over its own, i.e. the lead is the build's path outside the cache (docs/NOTES.md).
F16_PATH = ("its build's f16 decodes faster than ours in the same run (its CPU matmuls: on Gemma3 the 168M-parameter "
            "output head is most of a step), while over its own f16 ours gains more")
KNOWN_SPEED_GAPS: dict[tuple[str, str], str] = {
    ("gemma-3-270m-q4_k_m.gguf", "ik:iq4_nl -khad -vhad"): F16_PATH,
    ("gemma-3-270m-q4_k_m.gguf", "ik:q4_0 -khad -vhad"): F16_PATH,
}


def _run_row(c: dict | None, n: int, source: str) -> dict | None:
    """A configuration's decode row after n tokens from one result file (one run)."""
    return ((c or {}).get("decode_runs") or {}).get(n, {}).get(source)


def _deep_cell(configs: dict, model: str, n: int, ours: dict, label: str, p: dict) -> tuple[str, bool, str | None]:
    """One peer's part of the long-prompt speed line: its text, whether it holds, the cause where it is behind."""
    if "error" in p or not p.get("decode_tps"):
        return f"{label} did not run ({p.get('error', '?')})", True, None
    text = f"{label} {p['decode_tps']:.1f} t/s ({p.get('decode_tps_vs_f16', 0):.2f}×)"
    if p["decode_tps"] <= ours["decode_tps"]:
        return text, True, None
    theirs, mine = (_run_row(configs.get(f"{b}:f16"), n, p["source"]) or {} for b in (label.split(":")[0], "ours"))
    why = KNOWN_SPEED_GAPS.get((model, label))
    ok = (why is not None and theirs.get("decode_tps", 0) > mine.get("decode_tps", float("inf"))
          and ours.get("decode_tps_vs_f16", 0) >= p.get("decode_tps_vs_f16", float("inf")))
    return (f"{text}, behind: its f16 {theirs.get('decode_tps', 0):.1f} t/s against ours "
            f"{mine.get('decode_tps', 0):.1f}"), ok, why or "?"


def _src_label(src: str) -> str:
    name, _, fill = src.partition("#")
    return Path(name).stem + (f", {fill} fill" if fill else "")


def _deep_speed(data: dict) -> str | None:
    """Decode after the deepest prompts (past DEPTH): ours (defaults) at least as many t/s as every peer cache at
    <= BUDGET bits, but for KNOWN_SPEED_GAPS, checked as that table says. Absolute t/s, not ratios, so only rows from
    one file (one run, one machine state) are set side by side; each build's f16 ratio is printed beside it."""
    parts, causes, ok = [], set(), True
    for model, configs in data.items():
        runs = (configs.get(OURS) or {}).get("decode_runs") or {}
        for n, src, r in sorted((n, src, r) for n, by in runs.items() for src, r in by.items()):
            if n <= DEPTH or "error" in r or not r.get("decode_tps"):
                continue
            peers = [(label, p) for label, c in _peers(configs) if within(bits(c)) and (p := _run_row(c, n, src))]
            if not peers:
                continue
            cells = [_deep_cell(configs, model, n, r, label, p) for label, p in peers]
            ok &= all(c[1] for c in cells)
            causes |= {c[2] for c in cells if c[2]}
            # several runs at this depth: each its own part; a cache filled call by call always says so
            fill = src.partition("#")[2]
            run = f" ({_src_label(src)})" if len(runs[n]) > 1 else f" ({fill} fill)" if fill else ""
            parts.append(f"{_short(model)} after {round(n / 1024)}K{run}: ours {r['decode_tps']:.1f} t/s "
                         f"({r.get('decode_tps_vs_f16', 0):.2f}× its f16); " + ", ".join(c[0] for c in cells))
    if not parts:
        return None
    return holds(ok, f"decode after a long prompt (t/s in one run; × each build's own f16): ours at least as fast as "
                     f"every peer cache at ≤ {BUDGET} bits/value, but where marked: " + "; ".join(parts)
                 + "".join(f". Behind: {c}" for c in sorted(causes)))


# weight types of a peer that beat ours (rq-convert recipes) at no more bits: the measured cause, named in the line;
# a key covers the type alone and the type with llama-quantize overrides (a mixture of it)
KNOWN_WEIGHT_GAPS: dict[str, str] = {
    "ik:IQ3_K+imat": "IQ3_K spends 3.44 bits on every body weight where ITQ3_S spends 3.125, and ours can add bits only "
                     "a whole tensor at a time (Q4_K: +1.4); at the 3.1-3.25-bit base types (IQ3_KS, IQ3_KT) ours "
                     "is lower (docs/NOTES.md)",
}


def _weight_gap(label: str) -> str | None:
    return next((why for k, why in KNOWN_WEIGHT_GAPS.items() if label == k or label.startswith(k + " ")), None)


def weight_verdict(results: Path) -> str | None:
    """Weights (versus-weights*.json): for every other build's type, ours (a recipe at no more bits per weight) has
    the lower KLD, but for KNOWN_WEIGHT_GAPS, which the line names with their cause. Our tree's upstream types
    (IQ3_S, IQ3_M: stock llama.cpp's code) count as the stock build's."""
    parts, ok, causes = [], True, set()
    for f in sorted(results.glob("versus-weights*.json")):
        rows = [r for r in json.loads(f.read_text()).get("quality", []) if r.get("kld_mean") is not None]
        # ours: rq-convert recipes (lower-case names); llama-quantize's types are upper case in every build
        ours = [r for r in rows if r["build"] == "ours" and not r["ftype"].isupper()]
        for p in (r for r in rows if r not in ours):
            mine = [r for r in ours if r["bpw"] <= p["bpw"]]
            best = min(mine, key=lambda r: r["kld_mean"]) if mine else None
            win = best is not None and best["kld_mean"] < p["kld_mean"]
            # a mixture (the type plus llama-quantize overrides) by its type: the weights table has the whole label
            name = p["label"].replace("ours:", "stock:").split(" ", 1)[0] + (" with overrides" if " " in p["label"]
                                                                               else "")
            known = _weight_gap(p["label"])
            ok &= win or known is not None
            vs = (f"{best['label'].split(':', 1)[1]} {best['kld_mean']:.4f} at {best['bpw']:.3f}" if best
                  else "none of ours at so few bits")
            parts.append(f"{name} {p['kld_mean']:.4f} at {p['bpw']:.3f} vs {vs}" + ("" if win else " (behind)"))
            causes |= {known} if not win and known else set()
    if not parts:
        return None
    return holds(ok, "weights (Qwen2.5, KLD at context 512, each build's own imatrix): at no more bits per weight "
                     "than each other build's 3-bit type, ours has the lower KLD, but where marked: " + "; ".join(parts)
                     + "".join(f". Behind: {c}" for c in sorted(causes)))


def verdicts(data: dict[str, dict[str, dict]]) -> list[str]:
    """What the tables say, each line checked where it claims an order (holds raises when it stops holding)."""
    speed = ". Then ".join(x for x in (_speed(data), _deep_speed(data)) if x)  # one line: README counts its lines
    lines = [_quality(data, "kld", _what("kld")), _quality(data, "decode", _what("decode")), _needles(data),
             speed, _start_up(data)]
    return [x for x in lines if x]


def all_verdicts(data: dict[str, dict[str, dict]], results: Path) -> list[str]:
    """The KV verdicts and the weights one: what README and REPORT both state."""
    return verdicts(data) + [w for w in [weight_verdict(results)] if w]


def short_table(results: Path, fmt: Callable[[float], str] = lambda x: f"{x:.3g}") -> list[str]:
    """README's rows: ours and each peer's best configuration at <= BUDGET bits (lowest Gemma3 2K KLD), per model."""
    data = load(results)
    order = [m for m in MODELS if m in data]
    pick: dict[str, str] = {}
    for label, c in data.get(order[0], {}).items() if order else []:
        b = c["build"]["name"]
        if label.endswith(":f16") or "error" in (c.get("kld") or {"error": 1}) or not within(bits(c)):
            continue
        if b not in pick or c["kld"]["kld_mean"] < data[order[0]][pick[b]]["kld"]["kld_mean"]:
            pick[b] = label
    rows = []
    for _, label in sorted(pick.items(), key=lambda kv: kv[0] != "ours"):
        cells = []
        for m in order:
            c = data[m].get(label)
            if not c or "kld" not in c or "error" in c["kld"]:
                cells.append("–")
                continue
            dec = c["decode"].get(DEPTH, {})
            speed = dec.get("decode_tps_vs_f16")
            cells.append(f"{bits(c):.2f} b: {fmt(c['kld']['kld_mean'])}" + ("" if speed is None else f", {speed:.2f}×"))
        rows.append((label, *cells))
    return [f"| {' | '.join(r)} |" for r in rows]
