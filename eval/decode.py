"""Decode-time KV quality: what a compressed cache costs while the model generates.

llama-perplexity scores every token as prefill. With deferred prefill (``--kv-deferred``,
``Llama(kv_deferred=True)``) a prompt attends to an exact F16 copy of its own K/V and only the first
single-token step switches to the quantised cache, so perplexity runs never see the compression. Here
each run prefills N tokens of text (batched, as a prompt), then feeds the next M tokens of the same
text one ``llama_decode`` call each (teacher forced: the true token, not a sampled one) and keeps the
logits of every step. Step 0 is the prefill's own logits (they predict token N); steps 1..M come from
decode calls. Each (N, cache type, deferred) run is scored against the F16-KV run of the same model
and tokens: KLD per step, same top-1, and the perplexity of those M+1 tokens under the run's own logits.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rotaryquant import bindings, kvtypes
from rotaryquant.bindings import accounting
from rotaryquant.errors import RQError
from rotaryquant.eval import logits
from rotaryquant.eval import roofline as rl

BASELINE = "f16"
ROOFLINE_STEP0 = 64  # prompt tokens of the run whose f16 decode stands for the depth-0 step
N_BATCH = 512  # prompt tokens per llama_decode call (and per ubatch)


class DecodeError(RQError):
    """Bad arguments (text too short, context too large, unknown cache type, ...) or a run that failed."""


# --- scoring (pure) ---------------------------------------------------------------------------

def score(base_logits: np.ndarray, run_logits: np.ndarray, targets: np.ndarray, rows: int = 8) -> dict:
    """Scores of one run against the baseline: rows are steps (step 0 = after the prefill).

    targets[i] is the token that step i predicts. rows: steps per float64 block (bounded memory).
    """
    base_logits, run_logits, targets = np.asarray(base_logits), np.asarray(run_logits), np.asarray(targets)
    if base_logits.shape != run_logits.shape or base_logits.ndim != 2 or targets.shape != base_logits.shape[:1]:
        raise ValueError(f"shapes do not match: baseline {base_logits.shape}, run {run_logits.shape}, "
                         f"targets {targets.shape}")
    klds, nll = [], []
    for a in range(0, len(targets), rows):
        b, r = base_logits[a:a + rows], run_logits[a:a + rows]
        klds.append(logits.kld_rows(b, r))
        lp = logits.log_softmax(np.asarray(r, np.float64))
        nll.append(-lp[np.arange(len(lp)), targets[a:a + rows]])
    k, nll = np.concatenate(klds), np.concatenate(nll)
    same = base_logits.argmax(axis=-1) == run_logits.argmax(axis=-1)
    return {
        "kld_mean": float(k.mean()),
        "kld_p99": float(np.percentile(k, 99)),
        "kld_max": float(k.max()),
        "kld_step0": float(k[0]),
        "same_top1_pct": float(100.0 * same.mean()),
        "ppl": perplexity(-nll),
        "kld_steps": [float(f"{x:.6g}") for x in k],
    }


def perplexity(token_logprobs: np.ndarray) -> float:
    """exp of the mean negative log-probability of the true tokens."""
    return float(np.exp(-np.mean(np.asarray(token_logprobs, np.float64))))


def prefill_chunks(n: int, n_batch: int = N_BATCH) -> list[int]:
    """Prompt chunk sizes, each one llama_decode call: none is a single token, because the first
    single-token call is what ends a deferred prefill."""
    if n < 2:
        raise DecodeError(f"prefill of {n} tokens: give at least 2 (one token is a decode step)")
    sizes = [n_batch] * (n // n_batch) + ([n % n_batch] if n % n_batch else [])
    if sizes[-1] == 1:
        sizes[-2] -= 1
        sizes[-1] = 2
    return sizes


# --- settings -----------------------------------------------------------------------------------

def deferred_supported() -> bool:
    """Whether the installed llama_cpp has the per-context deferred-prefill setting (llama_context_params)."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    return any(f[0] == "kv_deferred" for f in llama_cpp.llama_context_params._fields_)


# --- runs ---------------------------------------------------------------------------------------

def text_tokens(model: Path, text: Path, n_tokens: int) -> list[int]:
    """The first n_tokens tokens of the text (BOS first); DecodeError when the text is shorter."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    raw = text.read_text(errors="replace")
    if len(raw.encode()) < n_tokens - 1:  # a token is at least one byte
        raise DecodeError(f"text {text} ({len(raw.encode())} bytes) is too short for {n_tokens} tokens "
                          "(prefill + decoded tokens + 1); use a longer text or a shorter prefill")
    voc = llama_cpp.Llama(model_path=str(model), vocab_only=True, n_ctx=16, verbose=False)
    try:
        # ~4 characters per token: tokenise a generous prefix first, the whole text only if needed
        toks = voc.tokenize(raw[: 8 * n_tokens].encode(), add_bos=True)
        if len(toks) < n_tokens and 8 * n_tokens < len(raw):
            toks = voc.tokenize(raw.encode(), add_bos=True)
        arch = voc.metadata.get("general.architecture", "")
        ctx_train = int(voc.metadata.get(f"{arch}.context_length", 0))
    finally:
        voc.close()
    if len(toks) < n_tokens:
        raise DecodeError(f"text {text} has {len(toks)} tokens for {model.name}; the longest run needs "
                          f"{n_tokens} (prefill + decoded tokens + 1): use a longer text or a shorter prefill")
    if ctx_train and n_tokens - 1 > ctx_train:
        raise DecodeError(f"prefill + decoded tokens ({n_tokens - 1}) is more than {model.name}'s training "
                          f"context {ctx_train}")
    return toks[:n_tokens]


def run_once(model: Path, tokens: list[int], *, n: int, m: int, cache: str, deferred: bool = False,
             threads: int = 2) -> dict:
    """Prefill tokens[:n], then decode tokens[n:n+m] one call each. Returns the M+1 rows of logits
    (float32, steps x vocab), wall-clock seconds of prefill and decode, and the RQ counters' change."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    if len(tokens) < n + m:
        raise DecodeError(f"{len(tokens)} tokens given for a prefill of {n} and {m} decoded tokens")
    tk, tv = (bindings.type_from_name(t) for t in kvtypes.split(cache))
    n_ctx = -(-(n + m) // 256) * 256
    try:
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
                              n_threads=threads, n_threads_batch=threads, flash_attn=True, type_k=tk,
                              type_v=tv, logits_all=False, verbose=False, kv_layer_types=kvtypes.layer_types(cache),
                              kv_window=kvtypes.window(cache),
                              **bindings.llama_kwargs(k_center="auto" if kvtypes.k_center(cache) else "off",
                                                      deferred=deferred))
    except (ValueError, RuntimeError) as e:
        hint = " (IsoQuant types need head size 64 or a multiple of 128)" if kvtypes.uses_iso(cache) else ""
        raise DecodeError(f"cannot create a {n_ctx}-token context with cache {cache} for {model.name}: "
                          f"{e}{hint}") from e
    try:
        n_vocab = llm.n_vocab()
        out = np.empty((m + 1, n_vocab), dtype=np.float32)

        def last_logits(i: int) -> None:
            out[i] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

        bindings.reset_counters()
        t0 = time.perf_counter()
        done = 0
        for size in prefill_chunks(n):
            llm.eval(tokens[done:done + size])  # one llama_decode: size <= n_batch
            done += size
        prefill_s = time.perf_counter() - t0
        last_logits(0)
        decode_s = 0.0
        for i, tok in enumerate(tokens[n:n + m], start=1):
            t0 = time.perf_counter()
            llm.eval([tok])
            decode_s += time.perf_counter() - t0
            last_logits(i)
        counters = bindings.kv_stats(llm)  # this context's deferred-prefill counters
        c = bindings.counters()
    finally:
        llm.close()
    # which fused CPU kernels attended the IsoQuant cache (None: none did)
    kernels = "AVX-512" if c["iso_avx512_calls"] else "float" if c["iso_fused_calls"] else None
    return {"logits": out, "prefill_s": prefill_s, "decode_s": decode_s, "counters": counters, "cpu_kernels": kernels,
            "key_split_ops": c["iso_split_calls"]}


def run(model: Path, text: Path, *, cache_types: list[str], prefill: list[int], tokens: int = 64,
        deferred: Sequence[bool] = (False, True), threads: int = 2, roofline: bool = False, rounds: int = 1,
        progress=print) -> dict:
    """Every (prefill, cache type, deferred) against the F16-KV baseline of the same prefill.

    rounds: run every configuration of a prefill that many times, interleaved, every other round in reverse order
    (ABBA: a drift of the machine's speed over the run weighs on both ends alike); speeds are the rounds' medians,
    with each round's ratio to f16 kept beside them. Logits (KLD) are the first round's.

    roofline: also measure the triad bandwidth and F32 rate before and after, and give each row its roofline t/s
    (rq-eval roofline's, f16's decode at the shortest prefill standing for the depth-0 step; a prefill of
    ROOFLINE_STEP0 tokens is added when every prefill is longer)."""
    if tokens < 1:
        raise DecodeError(f"decoded tokens must be at least 1, got {tokens}")
    if rounds < 1:
        raise DecodeError(f"rounds must be at least 1, got {rounds}")
    if not prefill or min(prefill) < 2:
        raise DecodeError(f"prefill lengths must be at least 2 tokens, got {prefill}")
    if not deferred:
        raise DecodeError("no deferred setting given (off, on or both)")
    for spec in cache_types:
        bindings.validate_kv_spec(spec)
    if any(deferred) and any(c != BASELINE for c in cache_types) and not deferred_supported():
        raise DecodeError("deferred prefill is not in this build (llama_context_params has no kv_deferred)",
                          fix="re-run `make setup`, or use --deferred off")

    prefill = sorted(set(prefill))
    if roofline and prefill[0] > ROOFLINE_STEP0:
        prefill = [ROOFLINE_STEP0, *prefill]  # the depth-0 step the roofline adds attention to
    toks = text_tokens(model, text, max(prefill) + tokens + 1)
    # per context: a recent window's F16 copies (+wN) are a share of it
    bits_at = {n: accounting.kv_bits_or_none(model, [BASELINE, *cache_types], n + tokens, progress) for n in prefill}
    rows = []
    t_start = time.time()
    rates = []
    if roofline:
        progress(f"[rq-eval decode] triad bandwidth and F32 matrix-product rate, {threads} threads")
        rates.append(rl.machine_rates(threads))
    for n in prefill:
        targets = np.asarray(toks[n:n + tokens + 1])
        bits = bits_at[n]
        configs = [(BASELINE, False), *((s, d) for s in cache_types if s != BASELINE for d in deferred)]
        first: dict[tuple[str, bool], dict] = {}
        secs: dict[tuple[str, bool], list[tuple[float, float]]] = {c: [] for c in configs}
        for rnd in range(rounds):
            for spec, d in configs if rnd % 2 == 0 else configs[::-1]:
                progress(f"[rq-eval decode] prefill {n}: {_label(spec, d)}" +
                         (f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""))
                r = run_once(model, toks, n=n, m=tokens, cache=spec, deferred=d, threads=threads)
                secs[(spec, d)].append((r["prefill_s"], r["decode_s"]))
                if rnd == 0:
                    first[(spec, d)] = r
                progress(f"[rq-eval decode]   prefill {n / r['prefill_s']:.1f} t/s, decode {tokens / r['decode_s']:.1f} t/s")
                del r
        base = first[(BASELINE, False)]
        for spec, d in configs:
            r = first.pop((spec, d))
            row = _row(n, spec, d, r, score(base["logits"], r["logits"], targets), tokens, bits)
            if rounds > 1:
                _with_rounds(row, n, tokens, secs[(spec, d)])
            rows.append(row)
            if spec != BASELINE:
                progress(f"[rq-eval decode]   {_label(spec, d)}: mean KLD {row['kld_mean']:.5f}, step-0 KLD "
                         f"{row['kld_step0']:.5f}, same top-1 {row['same_top1_pct']:.1f}%")
            del r
        del base
    compare(rows)
    res = {"model": model.name, "text": text.name, "tokens": tokens, "prefill": list(prefill), "threads": threads,
           "n_batch": N_BATCH, "rounds": rounds, "seconds": round(time.time() - t_start), "rows": rows}
    if roofline:
        rates.append(rl.machine_rates(threads))
        bw, rate = (sum(x) / 2 for x in zip(*rates))
        costs = rl.step_costs(model, sorted({r["cache"] for r in rows}), prefill, tokens)
        with_roofline(rows, costs, bw, rate)
        res["roofline"] = {"bandwidth": [x[0] for x in rates], "f32_rate": [x[1] for x in rates],
                           "bandwidth_used": bw, "f32_rate_used": rate, "step0_prefill": prefill[0]}
    return res


def _label(cache: str, deferred: bool) -> str:
    return f"{cache} baseline" if cache == BASELINE else cache + (" deferred" if deferred else "")


def _with_rounds(row: dict, n: int, m: int, secs: list[tuple[float, float]]) -> None:
    """A row's speeds from several rounds: the medians, and each round's t/s."""
    for k, tok, i in (("prefill_tps", n, 0), ("decode_tps", m, 1)):
        tps = [round(tok / s[i], 2) if s[i] else None for s in secs]
        row[k + "_rounds"] = tps
        row[k] = round(statistics.median(tps), 2) if None not in tps else None


def compare(rows: list[dict]) -> None:
    """Each row's prefill and decode t/s over the f16 baseline's at the same prefill (same run); with rounds, also
    each round's ratio (the baseline's same round)."""
    base = {r["prefill"]: r for r in rows if r["cache"] == BASELINE}
    for r in rows:
        b = base.get(r["prefill"])
        for k in ("prefill_tps", "decode_tps"):
            ok = b is not None and b[k] and r[k]
            r[k.replace("_tps", "_vs_f16")] = r[k] / b[k] if ok else None
            if b is not None and r.get(k + "_rounds") and b.get(k + "_rounds"):
                r[k.replace("_tps", "_vs_f16") + "_rounds"] = [x / y if x and y else None
                                                               for x, y in zip(r[k + "_rounds"], b[k + "_rounds"])]


def with_roofline(rows: list[dict], costs: dict[tuple[str, int], tuple[int, float]], bandwidth: float,
                  rate: float) -> None:
    """Each row's roofline t/s (rq-eval roofline's formula) and decode t/s over it. f16's decode after the shortest
    prefill is the depth-0 step; costs[(cache, prefill)] = (K/V bytes, attention FLOPs) of that row's step."""
    base = {r["prefill"]: r for r in rows if r["cache"] == BASELINE}
    if not base or not base[min(base)]["decode_tps"]:
        raise DecodeError("the roofline needs the f16 baseline's decode t/s at the shortest prefill")
    step0 = base[min(base)]["decode_tps"]
    for r in rows:
        kv, flops = costs[(r["cache"], r["prefill"])]
        r["roofline_tps"] = rl.roofline_tps(step0, kv, bandwidth, flops, rate)
        r["decode_over_roofline"] = r["decode_tps"] / r["roofline_tps"] if r["decode_tps"] else None


def _row(n: int, cache: str, deferred: bool, r: dict, s: dict, m: int, bits: dict[str, float]) -> dict:
    bpv = None if cache not in bits else round(bits[cache], 3)
    return {"prefill": n, "cache": cache, "deferred": deferred, "bits_per_value": bpv, **s,
            "prefill_tps": round(n / r["prefill_s"], 2) if r["prefill_s"] else None,
            "decode_tps": round(m / r["decode_s"], 2) if r["decode_s"] else None,
            "counters": r["counters"], "cpu_kernels": r.get("cpu_kernels"), "key_split_ops": r.get("key_split_ops", 0)}


def to_markdown(res: dict, title: str = "Decode-time KV quality") -> str:
    m = res["tokens"]
    lines = [f"## {title}: {res['model']}", "",
             f"Text {res['text']}: prefill N tokens, then {m} tokens teacher-forced one `llama_decode` each. "
             f"KLD per step against the F16-KV run of the same tokens, over {m + 1} steps; step 0 is the "
             "prefill's own logits (predicting token N), steps 1.."
             f"{m} are decode steps. PPL: those {m + 1} tokens under the run's own logits. Deferred: the "
             "prompt attends an exact F16 copy of its K/V until the first decode step. Speeds: wall clock of "
             f"the prefill's llama_decode calls ({res.get('n_batch', N_BATCH)} tokens each) and of the decode "
             f"steps, {res.get('threads', '?')} threads; vs f16: over the f16 run of the same prefill.", ""]
    if res.get("note"):
        lines += [f"Note: {res['note']}", ""]
    rounds = res.get("rounds", 1)
    if rounds > 1:
        lines += [f"Speeds: medians of {rounds} interleaved rounds, every other one in reverse order (f16, A, B, then "
                  "B, A, f16); \"per round\": each round's prefill t/s over f16's in the same round. KLD: the first "
                  "round's logits.", ""]
    rl = res.get("roofline")
    if rl:
        lines += [f"Roofline (rq-eval roofline's): 1 / (f16's decode step after {rl['step0_prefill']} tokens + "
                  "max(K/V bytes / bandwidth, attention FLOPs / F32 rate)); triad bandwidth "
                  f"{rl['bandwidth'][0] / 1e9:.1f} GB/s before, {rl['bandwidth'][1] / 1e9:.1f} after; F32 rate "
                  f"{rl['f32_rate'][0] / 1e9:.0f} GFLOP/s before, {rl['f32_rate'][1] / 1e9:.0f} after (means used).",
                  ""]
    kinds = sorted({r["cpu_kernels"] for r in res["rows"] if r.get("cpu_kernels")})
    if kinds:
        lines += ["IsoQuant attention on the CPU: " + " and ".join(
            "AVX-512 kernels (VNNI scores, bf16 V; GGML_RQ_CPU_AVX512=0 takes the float ones)" if k == "AVX-512"
            else "float kernels" for k in kinds) + ".", ""]
    if any(r.get("key_split_ops") for r in res["rows"]):
        lines += ["Single-token decode with fewer K/V heads than threads: the threads split each head's keys "
                  "(GGML_RQ_CPU_SPLIT=0: rows only; same bits).", ""]
    extra = (" prefill vs f16 per round |" if rounds > 1 else "") + (" roofline t/s | decode / roofline |" if rl else "")
    lines += ["| prefill N | cache | bits/value | deferred | mean KLD | KLD p99 | max KLD | same top-1 % | PPL "
              "| step-0 KLD | prefill t/s | decode t/s | prefill vs f16 | decode vs f16 |" + extra,
              "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * extra.count("|")]
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    notes = set()
    rows = [dict(r) for r in res["rows"]]
    if any("decode_vs_f16" not in r for r in rows):
        compare(rows)  # results from before the ratios were stored: the same run's f16 rows
    for r in rows:
        if r["cache"] == BASELINE:
            d = "(baseline)"
        elif r["deferred"]:
            c = r.get("counters") or {}
            d = "on" if c.get("kv_deferred_conversions") else "on (no effect¹)"
            if not c.get("kv_deferred_conversions"):
                notes.add("¹ deferred prefill was switched on, but no sequence converted from its transient "
                          "(kv_deferred_conversions = 0): the build ignores the switch for this cache.")
        else:
            d = "off"
        bpv = "–" if r.get("bits_per_value") is None else f"{r['bits_per_value']:.3f}"
        line = (f"| {r['prefill']} | {r['cache']} | {bpv} | {d} | {r['kld_mean']:.5f} | {r['kld_p99']:.5f} "
                f"| {r['kld_max']:.5f} | {r['same_top1_pct']:.1f} | {r['ppl']:.3f} | {r['kld_step0']:.5f} "
                f"| {f(r['prefill_tps'], 1)} | {f(r['decode_tps'], 1)} | {f(r.get('prefill_vs_f16'))} "
                f"| {f(r.get('decode_vs_f16'))} |")
        if rounds > 1:
            line += " " + " / ".join(f(x) for x in r.get("prefill_vs_f16_rounds") or [None]) + " |"
        if rl:
            line += f" {f(r.get('roofline_tps'), 1)} | {f(r.get('decode_over_roofline'))} |"
        lines.append(line)
    return "\n".join(lines + ([""] + sorted(notes) if notes else [])) + "\n"
