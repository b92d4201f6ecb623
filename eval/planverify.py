"""The table of ``rq-plan --verify``'s results (docs/results/plan-verify.json: written by
:mod:`rotaryquant.plan_verify`, which runs the planner against llama-server), for that command and for
``rq-eval report``."""

from __future__ import annotations

TOLERANCE = 0.10   # the target: predictions within +-10% of measured peak RSS
_MiB = 1 << 20


def _mib(n: float) -> float:
    return n / _MiB


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = ["## rq-plan: predicted vs measured peak RSS", "",
             f"{res['date']}, {m['cpu']} ({m['cores']} cores); `rq-plan --verify`: llama-server started with the "
             "plan's own command line, one request filling the context (prompt of ctx - 16 tokens, 8 generated); "
             f"measured = VmHWM of the server after the request. Target: within ±{100 * TOLERANCE:.0f}%. Sizes in MiB; "
             "weights copied = repacked for the CPU matmuls (their mapped pages stay resident too); base = the "
             "server's own code, heap and vocabulary (constant measured on SmolLM2 and Gemma3 at ctx 512).", "",
             "| model | ctx | KV | weights mapped | weights copied | KV | compute | base | deferred transient "
             "(library's peak counter) | predicted | measured VmHWM | error |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        p = r["predicted"]
        def f(k: str, p: dict = p) -> str:
            return f"{_mib(p.get(k, 0)):.0f}"
        ctr = r.get("counters", {}).get("kv_deferred_peak_bytes")
        dfr = f"{_mib(p.get('transient', 0)):.1f} ({_mib(ctr):.1f})" if r.get("deferred") else "–"
        kv = r["kv"] + (" --kv-deferred" if r.get("deferred") else "")
        ctx = f"{r['ctx']} x {r['parallel']}" if r.get("parallel", 1) > 1 else str(r["ctx"])
        lines.append(f"| {r['model']} | {ctx} | {kv} | {f('weights_mapped')} | {f('weights_copied')} "
                     f"| {f('kv')} | {f('compute')} | {f('base')} | {dfr} | {_mib(r['predicted_peak']):.0f} "
                     f"| {_mib(r['measured_peak']):.0f} | {r['error_pct']:+.1f}% |")
    if any(r.get("deferred") for r in res["rows"]):
        lines += ["", "With --kv-deferred the transient rq-plan adds (F16 K/V of every cache cell: eq. 12 with "
                  "llama.cpp's cache sizes) equals the library's own peak counter; the prompt graphs' extra working "
                  "memory in deferred mode is not reserved by llama.cpp in advance and so not predicted: that is "
                  "the rest of the difference."]
    for x in res.get("moe", []):
        lines += ["", f"MoE expert placement ({x['model']}): planned for {_mib(x['vram_budget']):.0f} MiB of VRAM, "
                  f"experts of the first {x['experts_on_cpu_layers']} layers to RAM with `-ot \"{x['rule']}\"`; "
                  f"llama-server (this CPU build, -ngl 99 --fit off -v) moved {len(x['moved_tensors'])} tensors "
                  f"({_mib(x['moved_bytes']):.1f} MiB, buffer {', '.join(x['buffer_types'])}), the plan named "
                  f"{len(x['planned_tensors'])} ({_mib(x['planned_expert_bytes']):.1f} MiB): "
                  f"{'match' if x['match'] else 'MISMATCH'}."]
    if res.get("paging"):
        pg = res["paging"]
        lines += ["", f"### Weights larger than RAM: {pg['model']} ({_mib(pg['file_bytes']):.0f} MiB, "
                  f"{_mib(pg['expert_bytes']):.0f} MiB of it routed experts, 4 of 64 used per token)", "",
                  f"llama-bench tg{pg['n_gen']}, {pg['threads']} threads, weights memory-mapped and not repacked "
                  "(`-lm mmap --repack 0`), the file's pages evicted before each run, the process in a child memory "
                  "cgroup (v1) of this session's own, limited to its anonymous memory "
                  f"({_mib(pg.get('anon', 0)):.0f} MiB, x1.2 + 16 MiB) + a fraction of the file; no swap. "
                  f"{pg.get('rounds', 1)} interleaved rounds, best t/s of each limit ({pg.get('date', '')}).", "",
                  "| cgroup limit | weights that fit | tg t/s (best) | all rounds | slowdown | major faults "
                  "| cgroup peak MiB |",
                  "|---:|---:|---:|---|---:|---:|---:|"]
        for r in pg["rows"]:
            lim = "none" if r["limit"] is None else f"{_mib(r['limit']):.0f} MiB"
            frac = "all" if r["fraction"] is None else f"{r['fraction']:.0%}"
            tps = f"{r['tg_tps']:.2f}" if r.get("tg_tps") else r.get("error", "–")
            slow = f"{r['slowdown']:.1f}x" if r.get("slowdown") else "–"
            allr = ", ".join(f"{x:.2f}" if x else "–" for x in r.get("runs_tps", []))
            lines.append(f"| {lim} | {frac} | {tps} | {allr} | {slow} | {r.get('total_pgmajfault', 0)} "
                         f"| {_mib(r['max_usage']):.0f} |")
    if res.get("timing"):
        t = res["timing"]
        lines += ["", f"rq-plan answer time: {t['model']} --budget {t['budget']} --ctx {t['ctx']}: "
                  f"{t['seconds']:.1f} s wall, whole command ({t['candidates']} candidates)."]
    return "\n".join(lines) + "\n"
