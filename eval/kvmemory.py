"""Deferred-prefill memory: the F16 transient measured against the RotaryQuant eq. 12 prediction.

Eq. 12 predicts the transient of a T-token prompt as 2·L·H_kv·d·T·2 bytes (K and V, F16). Each run is a
fresh process (RSS is per process), with and without deferred prefill: resident memory after the context
is created, after the prompt, after the first decode step, and the peak. The transient is the extra memory
a deferred prompt holds (with minus without, after the prompt) and it must be gone after the first step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rotaryquant import bindings, data, kvtypes
from rotaryquant.errors import RQError
from rotaryquant.eval import kvbench
from rotaryquant.eval.serve import proc_status_mib


def eq12_bytes(model: Path, n_tokens: int) -> int:
    """2·L·H_kv·d·T·2 summed over the model's layers (K and V widths may differ per layer)."""
    shape = kvbench.kv_shape(model)
    return sum(k + v for k, v in zip(shape.n_embd_k_gqa, shape.n_embd_v_gqa)) * 2 * n_tokens


def _child(model: str, cache: str, n_tokens: int, deferred: bool, threads: int) -> dict:
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    llama_cpp._logger.set_verbose(False)
    tk, tv = (bindings.type_from_name(t) for t in kvtypes.split(cache))
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_tokens + 256, n_batch=512, n_ubatch=512, n_threads=threads,
                          type_k=tk, type_v=tv, flash_attn=True, verbose=False, kv_deferred=deferred,
                          k_center=kvtypes.k_center(cache), kv_layer_types=kvtypes.layer_types(cache),
                          kv_window=kvtypes.window(cache))
    ids = llm.tokenize(data.evaluation_text().read_bytes()[: n_tokens * 8])[:n_tokens]
    if len(ids) < n_tokens:
        raise ValueError(f"the evaluation text has only {len(ids)} tokens, fewer than {n_tokens}")
    rss = {"context": proc_status_mib(os.getpid())["VmRSS"]}
    llm.eval(ids)
    rss["prompt"] = proc_status_mib(os.getpid())["VmRSS"]
    c = bindings.kv_stats(llm)
    llm.eval([ids[0]])  # the first decode step gives the transient back
    st = proc_status_mib(os.getpid())
    rss["decode"], rss["peak"] = st["VmRSS"], st["VmHWM"]
    return {"rss_mib": rss, "counter_peak_bytes": c["kv_deferred_peak_bytes"],
            "counter_bytes_after": bindings.kv_stats(llm)["kv_deferred_bytes"]}


def measure(model: Path, cache: str, n_tokens: int, deferred: bool, threads: int = 2, timeout: float = 1800) -> dict:
    code = ("import json, sys; from rotaryquant.eval import kvmemory; "
            f"print(json.dumps(kvmemory._child({str(model)!r}, {cache!r}, {n_tokens}, {deferred}, {threads})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RQError(f"memory run failed ({cache}, {n_tokens} tokens, deferred={deferred}): {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(model: Path, *, caches: list[str], prompts: list[int], threads: int = 2, progress=print) -> dict:
    rows = []
    t0 = time.time()
    for n in prompts:
        pred = eq12_bytes(model, n)
        for cache in caches:
            progress(f"[rq-eval memory] {cache}, {n}-token prompt: without and with deferred prefill")
            plain = measure(model, cache, n, False, threads)
            dfr = measure(model, cache, n, True, threads)
            p, d = plain["rss_mib"], dfr["rss_mib"]
            transient = (d["prompt"] - d["context"]) - (p["prompt"] - p["context"])
            released = (d["prompt"] - d["decode"]) - (p["prompt"] - p["decode"])
            rows.append({
                "cache": cache, "prompt": n, "eq12_mib": round(pred / 2**20, 2),
                "counter_peak_mib": round(dfr["counter_peak_bytes"] / 2**20, 2),
                "transient_mib": round(transient, 1),
                "transient_over_eq12": round(transient * 2**20 / pred, 3) if pred else None,
                "released_mib": round(released, 1),
                "released_over_eq12": round(released * 2**20 / pred, 3) if pred else None,
                "after_decode_extra_mib": round((d["decode"] - d["context"]) - (p["decode"] - p["context"]), 1),
                "peak_mib": {"plain": p["peak"], "deferred": d["peak"]},
                "counter_bytes_after": dfr["counter_bytes_after"],
                "rss_mib": {"plain": p, "deferred": d},
            })
    return {"model": model.name, "threads": threads, "seconds": round(time.time() - t0), "rows": rows}


def to_markdown(res: dict) -> str:
    lines = [f"## Deferred prefill memory: {res['model']}", "",
             "Fresh process per run; eq. 12 = 2·L·H_kv·d·T·2 bytes. 'Counter' = the transient rows in use at the end "
             "of the prompt (kv_deferred_peak_bytes). 'Released' = resident memory given back by the first decode "
             "step (with minus without deferral). 'Extra at prompt end' = RSS growth over the prompt, with minus "
             "without; 'kept' = the same after the first decode step: compute-buffer pages the prompt graphs of "
             "deferred prefill touch (reserved either way, resident once touched).", "",
             "| cache | prompt T | eq. 12 MiB | counter MiB | released MiB | released / eq. 12 | extra at prompt end MiB "
             "| kept MiB | peak RSS plain → deferred MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['cache']} | {r['prompt']} | {r['eq12_mib']:.1f} | {r['counter_peak_mib']:.1f} "
                     f"| {r['released_mib']:.1f} | {r['released_over_eq12']:.2f} | {r['transient_mib']:.1f} "
                     f"| {r['after_decode_extra_mib']:+.1f} | {r['peak_mib']['plain']:.0f} → {r['peak_mib']['deferred']:.0f} |")
    return "\n".join(lines) + "\n"
