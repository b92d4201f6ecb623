"""Decode roofline: how fast a decode step could be if streaming its bytes from memory were all it did.

One decode step reads every weight once (the token embeddings: one row, unless the output is tied to them) and
the K/V of every cell each layer attends. Its bytes, over the bandwidth this machine reaches with the threads
llama-bench uses, bound decode t/s from above:

    predicted t/s = bandwidth / (weight bytes + K/V bytes at depth d)

- bandwidth: a STREAM-style triad (a = b + c, 3 x 128 MiB of F32, counted as 3 arrays moved) run as a ggml
  graph in this process, with ggml-cpu's own threads (the ones llama.cpp decodes with); the best of
  several repetitions, as STREAM reports.
- K/V bytes at depth d: what llama.cpp allocates for a context of d cells with llama-bench's batch sizes
  (a no-alloc context: llama_rq_get_memory), which is what a step's attention views: every used cell of each
  full-attention layer, the whole window-sized cache of each sliding-window layer, per-layer types included.
- weight bytes: the GGUF's tensor sizes.

A measured/predicted ratio near 1 means decode is memory-bound and the cache format can only win by being
smaller; far below 1, compute or overheads (attention kernels, threading, graph set-up) are the limit.

On a machine where even the weights do not stream at the triad's rate (2 cores: a depth-0 step runs at about
half of its bound), no cache format reaches that bound, so a second limit isolates what the cache controls:

    cache limit t/s = 1 / (measured f16 step time at depth 0 + K/V bytes at depth d / bandwidth)

the weights as fast as this machine really runs them, the K/V streamed at the triad's rate, attention
arithmetic free. measured / cache limit is how close the attention path comes to a free read of its cache.

Attention is not free of arithmetic: at depth d each query head multiplies-and-adds every K and V value its KV
head holds (2 FLOPs each for the scores, 2 for the weighted sum of V), whatever format stores them. On few cores
that work, not the read, is what a long-context step waits on, so the roofline takes the slower of the two:

    roofline t/s = 1 / (measured f16 step at depth 0 + max(K/V bytes / bandwidth, attention FLOPs / F32 rate))

- F32 rate: FLOP/s of a cache-resident F32 matrix product (ggml_mul_mat, 512 x 512 x 512) with the same threads,
  best of several: the multiply-add rate ggml reaches here, measured like the triad, not a datasheet peak.
- attention FLOPs: 2 x (query heads / KV heads) x the K and V values the step attends (the f16 cache's bytes / 2,
  so sliding-window layers count their window), the same for every cache type: a compressed cache changes what
  is read, not how many products a float kernel takes.

measured / roofline is how close a path comes to this machine's limit for the step it runs.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rotaryquant import gguf_io, machine
from rotaryquant.bindings import ggml as _g
from rotaryquant.bindings.accounting import NoAllocModel
from rotaryquant.errors import PlanError
from rotaryquant.eval import kvbench

MIB = 1 << 20
TRIAD_MIB = 128


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """ggml-base and ggml-cpu with the prototypes of the calls below (a graph of one op, computed in a context)."""
    base = _g._ggml()
    cpu = ctypes.CDLL(str(_g.lib_dir() / "libggml-cpu.so"))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, res, args in (("ggml_init", vp, [_InitParams]), ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64]),
                            ("ggml_add", vp, [vp, vp, vp]), ("ggml_mul_mat", vp, [vp, vp, vp]),
                            ("ggml_new_graph", vp, [vp]), ("ggml_build_forward_expand", None, [vp, vp]),
                            ("ggml_get_data", vp, [vp]), ("ggml_free", None, [vp]),
                            ("ggml_graph_node", vp, [vp, ctypes.c_int])):
        getattr(base, name).restype = res
        getattr(base, name).argtypes = args
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    return base, cpu


def triad_bandwidth(threads: int, mib: int = TRIAD_MIB, reps: int = 7) -> float:
    """Bytes/s of a = b + c over ``mib`` MiB per array with ggml-cpu and ``threads`` threads (best of reps)."""
    base, cpu = _libs()
    n = mib * MIB // 4
    ne0 = 4096  # rows of 16 KiB: ggml-cpu splits a binary op's rows across its threads
    ctx = base.ggml_init(_InitParams(3 * n * 4 + 64 * MIB, None, False))
    if not ctx:
        raise MemoryError(f"ggml_init could not allocate {3 * mib} MiB")
    try:
        b = base.ggml_new_tensor_2d(ctx, 0, ne0, n // ne0)  # GGML_TYPE_F32
        c = base.ggml_new_tensor_2d(ctx, 0, ne0, n // ne0)
        for t, v in ((b, 1.0), (c, 2.0)):  # touch every page before timing
            ctypes.memset(base.ggml_get_data(t), 0, n * 4)
            (ctypes.c_float * n).from_address(base.ggml_get_data(t))[0] = v
        gf = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(gf, base.ggml_add(ctx, b, c))
        cpu.ggml_graph_compute_with_ctx(ctx, gf, threads)  # warm-up: the output's pages
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            if cpu.ggml_graph_compute_with_ctx(ctx, gf, threads) != 0:
                raise RuntimeError("ggml_graph_compute failed")
            best = min(best, time.perf_counter() - t0)
        out = (ctypes.c_float * n).from_address(base.ggml_get_data(base.ggml_graph_node(gf, -1)))
        if out[0] != 3.0 or out[n - 1] != 0.0:  # the graph ran: 1 + 2 in the first cell, 0 + 0 in the last
            raise RuntimeError(f"triad result wrong: {out[0]}, {out[n - 1]}")
    finally:
        base.ggml_free(ctx)
    return 3 * n * 4 / best


def f32_rate(threads: int, n: int = 512, reps: int = 7) -> float:
    """FLOP/s of an n x n x n F32 ggml_mul_mat with ggml-cpu and ``threads`` threads (best of reps; 2 n^3 FLOPs)."""
    base, cpu = _libs()
    ctx = base.ggml_init(_InitParams(3 * n * n * 4 + 64 * MIB, None, False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        a = base.ggml_new_tensor_2d(ctx, 0, n, n)  # GGML_TYPE_F32
        b = base.ggml_new_tensor_2d(ctx, 0, n, n)
        for t, v in ((a, 0.5), (b, 2.0)):
            np.ctypeslib.as_array((ctypes.c_float * (n * n)).from_address(base.ggml_get_data(t)))[:] = v
        gf = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(gf, base.ggml_mul_mat(ctx, a, b))
        best = float("inf")
        for i in range(reps + 1):  # the first run warms the caches and the threads
            t0 = time.perf_counter()
            if cpu.ggml_graph_compute_with_ctx(ctx, gf, threads) != 0:
                raise RuntimeError("ggml_graph_compute failed")
            if i:
                best = min(best, time.perf_counter() - t0)
        out = (ctypes.c_float * (n * n)).from_address(base.ggml_get_data(base.ggml_graph_node(gf, -1)))
        if out[0] != n or out[n * n - 1] != n:  # sum of n products 0.5 * 2: the product ran
            raise RuntimeError(f"matrix product wrong: {out[0]}, {out[n * n - 1]} (expected {n})")
    finally:
        base.ggml_free(ctx)
    return 2 * n**3 / best


def attention_flops(gguf: Path, kv_f16_bytes: int) -> float:
    """FLOPs of a decode step's attention: 2 per K value and 2 per V value attended, once per query head sharing
    them (kv_f16_bytes: the step's K/V in an f16 cache, 2 bytes a value)."""
    h = gguf_io.read_header(gguf)
    n_head, n_head_kv = h.get("attention.head_count"), h.get("attention.head_count_kv")
    if isinstance(n_head, list) or isinstance(n_head_kv, list) or not n_head:
        raise ValueError(f"{gguf.name}: per-layer or missing head counts ({n_head}, {n_head_kv})")
    return 2.0 * (kv_f16_bytes / 2) * (n_head / (n_head_kv or n_head))


def weight_bytes(gguf: Path) -> int:
    """Bytes of weights one decode step reads: every tensor, but one row of the token embeddings when a separate
    output matrix exists (with a tied output the whole table is read as the output)."""
    tensors = {t.name: t for t in gguf_io.read_header(gguf).tensors}
    total = sum(t.nbytes for t in tensors.values())
    emb = tensors.get("token_embd.weight")
    if emb is not None and "output.weight" in tensors:
        total -= emb.nbytes - emb.nbytes // emb.ne[1]
    return total


@dataclass
class Bound:
    cache: str
    depth: int
    weight_bytes: int
    kv_bytes: int
    bandwidth: float     # bytes/s
    predicted_tps: float

    @property
    def step_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def kv_bytes(gguf: Path, specs: list[str], depths: list[int], n_gen: int = 32) -> dict[tuple[str, int], int]:
    """K+V bytes each decode step attends at each depth (the llama-bench context of depth + n_gen cells)."""
    out = {}
    with NoAllocModel(gguf) as m:
        for spec in specs:
            for d in depths:
                c = m.context(spec, max(d + n_gen, 256), swa_full=False)
                if c.error:
                    raise PlanError(f"KV spec {spec!r}: {c.error}")
                out[(spec, d)] = c.kv
    return out


def bounds(gguf: Path, specs: list[str], depths: list[int], bandwidth: float, n_gen: int = 32) -> list[Bound]:
    w = weight_bytes(gguf)
    kv = kv_bytes(gguf, specs, depths, n_gen)
    return [Bound(s, d, w, kv[(s, d)], bandwidth, bandwidth / (w + kv[(s, d)])) for s in specs for d in depths]


def step_costs(gguf: Path, specs: list[str], depths: list[int], n_gen: int = 32) -> dict[tuple[str, int], tuple[int, float]]:
    """(K/V bytes, attention FLOPs) of a decode step of each spec at each depth."""
    kv = kv_bytes(gguf, sorted(set(specs) | {"f16"}), depths, n_gen)
    return {(s, d): (kv[(s, d)], attention_flops(gguf, kv[("f16", d)])) for s in specs for d in depths}


def machine_rates(threads: int) -> tuple[float, float]:
    """(triad bytes/s, F32 FLOP/s) with ``threads`` threads: what the roofline divides by."""
    return triad_bandwidth(threads), f32_rate(threads)


def cache_limit_tps(tps_depth0: float, kv_bytes: int, bandwidth: float) -> float:
    """Decode t/s if a step cost the measured depth-0 step plus streaming ``kv_bytes`` at ``bandwidth``."""
    return 1.0 / (1.0 / tps_depth0 + kv_bytes / bandwidth)


def roofline_tps(tps_depth0: float, kv_bytes: int, bandwidth: float, flops: float, rate: float) -> float:
    """Decode t/s if a step cost the measured depth-0 step plus its attention at the slower of reading the K/V at
    ``bandwidth`` and doing its ``flops`` at ``rate``."""
    return 1.0 / (1.0 / tps_depth0 + max(kv_bytes / bandwidth, flops / rate))


def as_rows(bs: list[Bound]) -> list[dict]:
    return [{**asdict(b), "step_bytes": b.step_bytes} for b in bs]


def run(model: Path, *, configs: list[tuple[str, str, bool]], depths: list[int], n_gen: int = 32, reps: int = 2,
        threads: int = 2, progress=print) -> dict:
    """Bandwidth (before and after), then llama-bench decode in interleaved rounds (rq-eval bench's runner), then
    each row's predicted t/s from the mean bandwidth and its measured/predicted ratio, and its cache limit (the
    measured f16 step at depth 0 plus the K/V at bandwidth; depth 0 is added to the runs when missing)."""
    t0 = time.time()
    progress(f"[rq-eval roofline] triad bandwidth and F32 matrix-product rate, {threads} threads")
    bw0, fr0 = machine_rates(threads)
    depths = sorted(set(depths) | {0})
    res = kvbench.bench(model, configs=configs, depths=depths, n_prompt=0, n_gen=n_gen, reps=reps, threads=threads,
                        progress=progress)
    bw1, fr1 = machine_rates(threads)
    bw = (bw0 + bw1) / 2
    rate = (fr0 + fr1) / 2
    specs = sorted({c[1] for c in configs})
    bound = {(b.cache, b.depth): b for b in bounds(model, specs, depths, bw, n_gen)}
    flops = {d: c[1] for (_, d), c in step_costs(model, ["f16"], depths, n_gen).items()}
    rows = []
    for r in res["rows"]:
        b = bound[(r["cache_type"], r["depth"])]
        row = {"label": r["label"], "cache": r["cache_type"], "unfused": r["unfused"], "depth": r["depth"],
               **as_rows([b])[0], "attn_flops": flops[r["depth"]],
               "tg_tps": r["tg_tps"], "tg_std": r["tg_std"],
               "measured_over_predicted": None if not r["tg_tps"] else r["tg_tps"] / b.predicted_tps}
        rows.append(row)
    f16_0 = next((x for x in rows if x["label"] == "f16" and x["depth"] == 0 and x["tg_tps"]), None)
    for r in rows:
        base = next((x for x in rows if x["label"] == "f16" and x["depth"] == r["depth"]), None)
        if base and base["tg_tps"] and r["tg_tps"]:
            r["tg_vs_f16"] = r["tg_tps"] / base["tg_tps"]
            r["predicted_vs_f16"] = r["predicted_tps"] / base["predicted_tps"]
        if f16_0:
            r["cache_limit_tps"] = cache_limit_tps(f16_0["tg_tps"], r["kv_bytes"], bw)
            r["measured_over_cache_limit"] = r["tg_tps"] / r["cache_limit_tps"] if r["tg_tps"] else None
            r["roofline_tps"] = roofline_tps(f16_0["tg_tps"], r["kv_bytes"], bw, r["attn_flops"], rate)
            r["measured_over_roofline"] = r["tg_tps"] / r["roofline_tps"] if r["tg_tps"] else None
    return {"model": model.name, "machine": machine.describe(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "bandwidth": {"before": bw0, "after": bw1, "used": bw, "triad_mib": TRIAD_MIB, "threads": threads},
            "f32_rate": {"before": fr0, "after": fr1, "used": rate, "n": 512, "threads": threads},
            "settings": {"n_gen": n_gen, "reps": reps, "threads": threads, "depths": depths},
            "seconds": round(time.time() - t0, 1), "rows": rows}


def to_markdown(res: dict) -> str:
    bw = res["bandwidth"]
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [f"## Decode roofline: {res['model']}", "",
             f"Bandwidth: triad (a = b + c, 3 x {bw['triad_mib']} MiB F32) through ggml-cpu with {bw['threads']} "
             f"threads, best of 7: {bw['before'] / 1e9:.2f} GB/s before the benchmark, {bw['after'] / 1e9:.2f} after; "
             f"predictions use the mean. Predicted t/s = bandwidth / (weights + K/V a step attends); cache limit t/s "
             f"= 1 / (f16's measured step at depth 0 + K/V / bandwidth): weights as fast as they run here, the cache "
             f"read for free of arithmetic. Measured: llama-bench tg{res['settings']['n_gen']} at each depth, "
             f"{res['settings']['reps']} interleaved rounds. {res['machine']}.", ""]
    fr = res.get("f32_rate")
    if fr:
        lines += [f"F32 rate: a {fr['n']} x {fr['n']} x {fr['n']} ggml_mul_mat with {fr['threads']} threads, best of 7: "
                  f"{fr['before'] / 1e9:.1f} GFLOP/s before, {fr['after'] / 1e9:.1f} after (mean used). Roofline t/s "
                  f"= 1 / (f16's measured step at depth 0 + max(K/V / bandwidth, attention FLOPs / F32 rate)): the "
                  f"attention's read or its arithmetic, whichever is slower, the same FLOPs for every cache type.",
                  ""]
    lines += ["| depth | cache | weights MiB | K/V MiB | attn GFLOP | predicted t/s | cache limit t/s | roofline t/s "
              "| measured t/s | measured / predicted | measured / cache limit | measured / roofline "
              "| measured vs f16 | predicted vs f16 |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(res["rows"], key=lambda r: (r["depth"], r["label"] != "f16", r["label"])):
        gf = r.get("attn_flops")
        lines.append(f"| {r['depth']} | {r['label']} | {r['weight_bytes'] / MIB:.0f} | {r['kv_bytes'] / MIB:.1f} "
                     f"| {f(gf and gf / 1e9)} | {r['predicted_tps']:.1f} | {f(r.get('cache_limit_tps'), 1)} "
                     f"| {f(r.get('roofline_tps'), 1)} | {f(r['tg_tps'], 1)} "
                     f"| {f(r['measured_over_predicted'])} | {f(r.get('measured_over_cache_limit'))} "
                     f"| {f(r.get('measured_over_roofline'))} | {f(r.get('tg_vs_f16'))} | {f(r.get('predicted_vs_f16'))} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, out: Path) -> Path:
    """t/s against depth per cache: measured (points, lines) and the predicted limit (dashed, same colour)."""
    import matplotlib  # lazy: optional (the eval extra), heavy; only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional (the eval extra), heavy; only the plots need it

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = list(dict.fromkeys(r["label"] for r in res["rows"]))
    for i, label in enumerate(labels):
        rs = sorted((r for r in res["rows"] if r["label"] == label), key=lambda r: r["depth"])
        c = f"C{i}"
        ax.plot([r["depth"] for r in rs], [r["predicted_tps"] for r in rs], "--", color=c, alpha=0.6)
        lim = [(r["depth"], r["cache_limit_tps"]) for r in rs if r.get("cache_limit_tps")]
        ax.plot([p[0] for p in lim], [p[1] for p in lim], ":", color=c, alpha=0.8)
        roof = [(r["depth"], r["roofline_tps"]) for r in rs if r.get("roofline_tps")]
        ax.plot([p[0] for p in roof], [p[1] for p in roof], "-.", color=c, alpha=0.8)
        pts = [(r["depth"], r["tg_tps"]) for r in rs if r["tg_tps"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=label)
    ax.set_xlabel("depth (tokens in the cache)")
    ax.set_ylabel("decode t/s")
    fr = res.get("f32_rate")
    rate = f", {fr['used'] / 1e9:.0f} GFLOP/s" if fr else ""
    ax.set_title(f"{res['model']}: measured (solid)\nlimits: bandwidth (dashed), cache (dotted), with attention "
                 f"arithmetic (dash-dot)\n{res['bandwidth']['used'] / 1e9:.1f} GB/s{rate}", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
