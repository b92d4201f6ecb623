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
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1 << 20
TRIAD_MIB = 128


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def triad_bandwidth(threads: int, mib: int = TRIAD_MIB, reps: int = 7) -> float:
    """Bytes/s of a = b + c over ``mib`` MiB per array with ggml-cpu and ``threads`` threads (best of reps)."""
    from rotaryquant.bindings import ggml as _g

    base = _g._ggml()
    cpu = ctypes.CDLL(str(_g.lib_dir() / "libggml-cpu.so"))
    base.ggml_init.restype = ctypes.c_void_p
    base.ggml_init.argtypes = [_InitParams]
    base.ggml_new_tensor_2d.restype = ctypes.c_void_p
    base.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_add.restype = ctypes.c_void_p
    base.ggml_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_new_graph.restype = ctypes.c_void_p
    base.ggml_new_graph.argtypes = [ctypes.c_void_p]
    base.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_get_data.restype = ctypes.c_void_p
    base.ggml_get_data.argtypes = [ctypes.c_void_p]
    base.ggml_free.argtypes = [ctypes.c_void_p]
    base.ggml_graph_node.restype = ctypes.c_void_p
    base.ggml_graph_node.argtypes = [ctypes.c_void_p, ctypes.c_int]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]

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


def weight_bytes(gguf: Path) -> int:
    """Bytes of weights one decode step reads: every tensor, but one row of the token embeddings when a separate
    output matrix exists (with a tied output the whole table is read as the output)."""
    from rotaryquant import gguf_io

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
    from rotaryquant.plan.accounting import NoAllocModel
    from rotaryquant.plan.errors import PlanError

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


def cache_limit_tps(tps_depth0: float, kv_bytes: int, bandwidth: float) -> float:
    """Decode t/s if a step cost the measured depth-0 step plus streaming ``kv_bytes`` at ``bandwidth``."""
    return 1.0 / (1.0 / tps_depth0 + kv_bytes / bandwidth)


def as_rows(bs: list[Bound]) -> list[dict]:
    return [{**asdict(b), "step_bytes": b.step_bytes} for b in bs]


def run(model: Path, *, configs: list[tuple[str, str, bool]], depths: list[int], n_gen: int = 32, reps: int = 2,
        threads: int = 2, progress=print) -> dict:
    """Bandwidth (before and after), then llama-bench decode in interleaved rounds (rq-eval bench's runner), then
    each row's predicted t/s from the mean bandwidth and its measured/predicted ratio, and its cache limit (the
    measured f16 step at depth 0 plus the K/V at bandwidth; depth 0 is added to the runs when missing)."""
    from rotaryquant import machine
    from rotaryquant.eval import kvbench

    t0 = time.time()
    progress(f"[rq-eval roofline] triad bandwidth, {threads} threads")
    bw0 = triad_bandwidth(threads)
    depths = sorted(set(depths) | {0})
    res = kvbench.bench(model, configs=configs, depths=depths, n_prompt=0, n_gen=n_gen, reps=reps, threads=threads,
                        progress=progress)
    bw1 = triad_bandwidth(threads)
    bw = (bw0 + bw1) / 2
    specs = sorted({c[1] for c in configs})
    bound = {(b.cache, b.depth): b for b in bounds(model, specs, depths, bw, n_gen)}
    rows = []
    for r in res["rows"]:
        b = bound[(r["cache_type"], r["depth"])]
        row = {"label": r["label"], "cache": r["cache_type"], "unfused": r["unfused"], "depth": r["depth"],
               **as_rows([b])[0], "tg_tps": r["tg_tps"], "tg_std": r["tg_std"],
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
    return {"model": model.name, "machine": machine.describe(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "bandwidth": {"before": bw0, "after": bw1, "used": bw, "triad_mib": TRIAD_MIB, "threads": threads},
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
             f"{res['settings']['reps']} interleaved rounds. {res['machine']}.", "",
             "| depth | cache | weights MiB | K/V MiB | predicted t/s | cache limit t/s | measured t/s "
             "| measured / predicted | measured / cache limit | measured vs f16 | predicted vs f16 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(res["rows"], key=lambda r: (r["depth"], r["label"] != "f16", r["label"])):
        lines.append(f"| {r['depth']} | {r['label']} | {r['weight_bytes'] / MIB:.0f} | {r['kv_bytes'] / MIB:.1f} "
                     f"| {r['predicted_tps']:.1f} | {f(r.get('cache_limit_tps'), 1)} | {f(r['tg_tps'], 1)} "
                     f"| {f(r['measured_over_predicted'])} | {f(r.get('measured_over_cache_limit'))} "
                     f"| {f(r.get('tg_vs_f16'))} | {f(r.get('predicted_vs_f16'))} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, out: Path) -> Path:
    """t/s against depth per cache: measured (points, lines) and the predicted limit (dashed, same colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = list(dict.fromkeys(r["label"] for r in res["rows"]))
    for i, label in enumerate(labels):
        rs = sorted((r for r in res["rows"] if r["label"] == label), key=lambda r: r["depth"])
        c = f"C{i}"
        ax.plot([r["depth"] for r in rs], [r["predicted_tps"] for r in rs], "--", color=c, alpha=0.6)
        lim = [(r["depth"], r["cache_limit_tps"]) for r in rs if r.get("cache_limit_tps")]
        ax.plot([p[0] for p in lim], [p[1] for p in lim], ":", color=c, alpha=0.8)
        pts = [(r["depth"], r["tg_tps"]) for r in rs if r["tg_tps"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=label)
    ax.set_xlabel("depth (tokens in the cache)")
    ax.set_ylabel("decode t/s")
    ax.set_title(f"{res['model']}\nmeasured (solid), bandwidth limit (dashed), cache limit (dotted), "
                 f"{res['bandwidth']['used'] / 1e9:.1f} GB/s", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
