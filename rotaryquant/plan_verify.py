"""rq-plan against reality: start llama-server with the plan's own command line, send one request that
fills the planned context, and compare the peak resident memory the kernel recorded (``VmHWM`` of
the server process) with the prediction. Also checks the CUDA plan's expert rules (``-ot``) by loading
a synthetic MoE with them: the tensors llama.cpp moves must be the plan's experts, byte for byte.

``rq-plan --verify`` runs the cases below and writes docs/results/plan-verify.json/.md (its table:
:func:`rotaryquant.eval.planverify.to_markdown`, which ``rq-eval report`` shows too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rotaryquant import assets, data, machine, paths
from rotaryquant import plan as P
from rotaryquant.bindings import tools
from rotaryquant.converter.convert import Options, convert
from rotaryquant.converter.hf_folders import qwen2moe_toy_folder, smollm2_hf_folder
from rotaryquant.errors import RQError
from rotaryquant.eval import serve
from rotaryquant.eval.planverify import TOLERANCE, to_markdown

RESULTS = paths.REPO / "docs" / "results"


class VerifyError(RQError):
    """A verification run that could not be made (server did not start, request failed, ...)."""


@dataclass(frozen=True)
class Case:
    name: str
    model: Path
    ctx: int
    kv: str
    parallel: int = 1
    deferred: bool = False           # plan (and run) with deferred prefill (--kv-deferred)
    extra: tuple[str, ...] = ()      # extra llama-server arguments (not memory-relevant ones)


def _server(cmd: list[str], *, env: dict[str, str] | None = None, start_timeout: float = 300):
    """llama-server `cmd` (without host/port): yields (url, pid, log path)."""
    return serve.launch(cmd, env=env, start_timeout=start_timeout, error=VerifyError)


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, urllib.error.HTTPError, ValueError) as e:
        raise VerifyError(f"{url}: {e}") from None


def status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of a process, bytes."""
    st = serve.proc_status(pid)
    return {k: st[k] for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile") if k in st}


_RX_LOG = {  # server log lines (printed at -v)
    "log_model_mib": re.compile(r"(\S+) model buffer size = +([0-9.]+) MiB"),
    "log_kv_mib": re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB"),
    "log_compute_reserved_mib": re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB"),
    "log_checkpoints_mib": re.compile(r"created context checkpoint \d+ of \d+ .*size = +([0-9.]+) MiB"),
}


def _log_sizes(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, rx in _RX_LOG.items():
        vals = [float(m.groups()[-1]) for m in rx.finditer(text)]
        if vals:
            out[key] = round(sum(vals), 2)
    return out


def prompt_tokens(base: str, n: int) -> list[int]:
    """n tokens of the evaluation text, tokenised by the server itself."""
    text = data.evaluation_text().read_text(errors="replace")[: max(4096, n * 12)]
    toks = _post(base + "/tokenize", {"content": text}, 300)["tokens"]
    if len(toks) < n:
        raise VerifyError(f"the evaluation text gives only {len(toks)} tokens, {n} wanted")
    return toks[:n]


def measure(case: Case, *, threads: int = 2, n_predict: int = 8, progress: Callable[[str], None] = print) -> dict:
    """The plan for ``case`` (the model as it is, its KV spec, generous budget), then llama-server with the
    plan's command line and one request of ctx - n_predict tokens; VmHWM vs the predicted peak."""
    plan = P.make_plan(case.model, budget=1 << 50, ctx=case.ctx, parallel=case.parallel, kv=[case.kv], recipes=[],
                       deferred=case.deferred)
    c = plan.winner
    if c is None or c.kv != case.kv:
        raise VerifyError(f"{case.name}: the plan has no candidate keep + {case.kv}")
    cmd = shlex.split(plan.commands[-1])
    if cmd[0].endswith("llama-server") and not Path(cmd[0]).is_absolute():
        cmd[0] = str(paths.REPO / cmd[0]) if (paths.REPO / cmd[0]).exists() else cmd[0]
    cmd += ["-t", str(threads), "--metrics", *case.extra]
    n_prompt = case.ctx - n_predict - 8
    progress(f"[rq-plan verify] {case.name}: {' '.join(cmd[1:])}")
    t0 = time.time()
    with _server(cmd) as (base, pid, log):
        idle = status(pid)
        toks = prompt_tokens(base, n_prompt)
        progress(f"[rq-plan verify] {case.name}: one request of {len(toks)} prompt tokens")
        r = _post(base + "/completion", {"prompt": toks, "n_predict": n_predict, "cache_prompt": False,
                                         "temperature": 0.0, "top_k": 1}, 3600)
        after = status(pid)
        try:
            counters = {k: v for k, v in serve.metrics(base).items() if "deferred" in k or "isoquant" in k}
        except (OSError, ValueError):
            counters = {}
        logs = _log_sizes(log.read_text(errors="replace"))
    measured = after["VmHWM"]
    err = (c.peak - measured) / measured
    row = {"case": case.name, "model": case.model.name, "ctx": case.ctx, "kv": case.kv, "parallel": case.parallel,
           "deferred": case.deferred,
           "predicted": {k: v for k, v in c.bytes.items()}, "predicted_peak": c.peak,
           "measured_peak": measured, "error_pct": round(100 * err, 2), "within": abs(err) <= TOLERANCE,
           "idle": idle, "after": after, "prompt_tokens": int(r.get("tokens_evaluated", len(toks))),
           "prompt_tps": round(float(r.get("timings", {}).get("prompt_per_second", 0.0)), 1),
           "server_args": cmd[1:], "seconds": round(time.time() - t0, 1), "counters": counters, **logs}
    progress(f"[rq-plan verify] {case.name}: predicted {P.mib(c.peak):.0f} MiB, measured VmHWM "
             f"{P.mib(measured):.0f} MiB ({100 * err:+.1f}%)")
    return row


# --- the synthetic MoE (routed experts on CPU: the -ot rules checked by loading) ---------------------

def synthetic_moe(workdir: Path, *, recipe: str = "rotaryquant", progress: Callable[[str], None] = print,
                  **shape: int) -> Path:
    """A random-weight Qwen2-MoE (shared expert + routed experts) converted by rq-convert: experts are
    most of its weights, as in the paper's models. ``shape``: qwen2moe_toy_folder's keyword arguments."""
    out = workdir / f"qwen2moe-synthetic-{recipe}.gguf"
    if out.exists():
        return out
    progress("[rq-plan verify] building the synthetic MoE (random Qwen2-MoE, SmolLM2 tokenizer)")
    tok = smollm2_hf_folder(assets.model_path("smollm2-135m"), workdir / "smollm2-2L", n_layers=2)
    sh = dict(hidden=512, n_layers=4, n_experts=64, n_used=4, moe_ff=768, shared_ff=1024)
    sh.update(shape)
    hf = qwen2moe_toy_folder(workdir / "qwen2moe-hf", tok, **sh)
    convert(hf, out, Options(recipe=recipe, progress=False, auto_calibrate=False))  # memory, not quality
    return out


_RX_OVERRIDDEN = re.compile(r"tensor (\S+) \((\d+) MiB (\S+)\) buffer type overridden to (\S+)")


def check_expert_rules(model: Path, *, vram: int, ctx: int = 1024, threads: int = 2,
                       progress: Callable[[str], None] = print) -> dict:
    """Plan the MoE for a GPU with ``vram`` bytes (so some experts must stay in RAM), then load it in
    llama-server with the emitted -ot rule: the tensors llama.cpp moves must be the plan's experts."""
    plan = P.make_plan(model, budget=vram, ctx=ctx, device="cuda", kv=["f16"], recipes=[])
    c = plan.winner
    assert c is not None
    cmd = shlex.split(plan.commands[-1])
    cmd[0] = str(paths.REPO / cmd[0]) if not Path(cmd[0]).is_absolute() else cmd[0]
    if "-ot" not in cmd:
        raise VerifyError(f"the plan for {vram / P.MiB:.0f} MiB of VRAM moves no experts: {plan.commands[-1]}")
    rule = cmd[cmd.index("-ot") + 1]
    h = P.read_header(model)
    rx = re.compile(rule.rsplit("=", 1)[0])
    planned = {t.name: t.nbytes for t in h.tensors if rx.search(t.name)}
    expect = {t.name for t in h.tensors if (m := P._EXPERTS.match(t.name)) and int(m.group(1)) < c.experts_on_cpu}
    progress(f"[rq-plan verify] MoE -ot check: {' '.join(cmd[1:])}")
    with _server([*cmd, "-t", str(threads), "-v", "--fit", "off"]) as (_base, pid, log):
        text = log.read_text(errors="replace")
        st = status(pid)
    moved = {m.group(1): m.group(4) for m in _RX_OVERRIDDEN.finditer(text)}
    moved_bytes = sum(planned.get(n, 0) for n in moved)
    return {"case": "moe-expert-rules", "model": model.name, "vram_budget": vram, "rule": rule,
            "experts_on_cpu_layers": c.experts_on_cpu, "planned_expert_bytes": c.bytes.get("experts_cpu", 0),
            "planned_tensors": sorted(expect), "moved_tensors": sorted(moved), "moved_bytes": moved_bytes,
            "buffer_types": sorted(set(moved.values())),
            "match": set(moved) == expect and moved_bytes == c.bytes.get("experts_cpu", 0), "rss": st,
            "predicted_vram": c.peak, "predicted_host": c.host}


# --- weights larger than RAM: memory-mapped experts paged from disk -----------------------------------

def _own_memory_cgroup() -> Path:
    """This process's cgroup-v1 memory controller folder (children created there stay inside it)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrl, rel = line.split(":", 2)
        if "memory" in ctrl.split(","):
            p = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            if (p / "memory.limit_in_bytes").exists():
                return p
    raise VerifyError("no cgroup-v1 memory controller here: the paging experiment needs one")


def evict(path: Path) -> None:
    """Drop the file's clean pages from the page cache, so that the next reads come from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextmanager
def memory_cgroup(limit: int | None) -> Iterator[Path]:
    """A child memory cgroup of this process's own, limited to ``limit`` bytes (None: no limit)."""
    cg = _own_memory_cgroup() / f"rq-plan-paging-{os.getpid()}-{time.monotonic_ns()}"
    cg.mkdir()
    try:
        if limit is not None:
            (cg / "memory.limit_in_bytes").write_text(str(limit))
        (cg / "memory.swappiness").write_text("0")
        yield cg
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.2)


def _cg_stat(cg: Path) -> dict[str, int]:
    out = {}
    for line in (cg / "memory.stat").read_text().splitlines():
        k, v = line.split()
        if k in ("rss", "cache", "mapped_file", "pgmajfault", "total_pgmajfault"):
            out[k] = int(v)
    out["max_usage"] = int((cg / "memory.max_usage_in_bytes").read_text())
    out["failcnt"] = int((cg / "memory.failcnt").read_text())
    return out


def decode_in_cgroup(model: Path, limit: int | None, *, n_gen: int = 32, threads: int = 2,
                     timeout: float = 900) -> dict:
    """llama-bench tg``n_gen`` with memory-mapped, non-repacked weights inside a memory cgroup, the file's
    pages evicted first. Returns t/s, major faults and the cgroup's peak usage."""
    cmd = [str(tools.binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(n_gen), "-r", "1", "-t", str(threads),
           "-fa", "1", "-lm", "mmap", "--repack", "0", "-o", "json"]
    evict(model)
    with memory_cgroup(limit) as cg:
        procs = cg / "cgroup.procs"
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: procs.write_text(str(os.getpid())))
        anon = 0
        try:
            while proc.poll() is None:        # the largest anonymous (unpageable: no swap) footprint
                with contextlib.suppress(OSError, KeyError):
                    anon = max(anon, status(proc.pid)["RssAnon"])
                if time.time() - t0 > timeout:
                    proc.kill()
                    proc.wait()
                    return {"limit": limit, "error": f"timed out after {timeout:.0f} s", "anon": anon, **_cg_stat(cg)}
                time.sleep(0.1)
            out, err = proc.communicate()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        st = _cg_stat(cg)
    row = {"limit": limit, "seconds": round(time.time() - t0, 1), "anon": anon, **st}
    if proc.returncode != 0:
        tail = err.strip().splitlines()[-1:] if err else []
        row["error"] = f"llama-bench exited {proc.returncode}" + (f": {tail[0]}" if tail else "")
        return row
    tg = next(r for r in json.loads(out) if r.get("n_gen"))
    row["tg_tps"] = round(float(tg["avg_ts"]), 3)
    return row


def paging_experiment(model: Path, *, fractions: tuple[float | None, ...] = (None, 0.75, 0.5, 0.25),
                      n_gen: int = 32, threads: int = 2, rounds: int = 3,
                      progress: Callable[[str], None] = print) -> dict:
    """Decode speed of ``model`` with its weights fully resident vs a cgroup that holds only a fraction
    of them (plus what the process needs anyway): pages of experts not recently used are dropped and
    read back from the disk, the CPU analogue of the paper's expert offload. ``rounds`` interleaved
    rounds over all limits; the best t/s of each is kept (the others are in "runs"), since another
    process on this machine can only slow a run down."""
    h = P.read_header(model)
    weights = h.file_size
    progress(f"[rq-plan verify] paging: {model.name}, {weights / P.MiB:.0f} MiB of memory-mapped weights")
    anon = decode_in_cgroup(model, None, n_gen=8, threads=threads)["anon"]   # unpageable (no swap)
    limits = [None if f is None else int(anon * 1.2 + 16 * P.MiB + f * weights) for f in fractions]
    runs: list[list[dict]] = [[] for _ in fractions]
    for rnd in range(rounds):
        for i, (f, lim) in enumerate(zip(fractions, limits)):
            progress(f"[rq-plan verify] paging round {rnd + 1}/{rounds}: "
                     + ("no limit" if lim is None else f"limit {lim / P.MiB:.0f} MiB ({f:.0%} of the weights)"))
            runs[i].append(decode_in_cgroup(model, lim, n_gen=n_gen, threads=threads))
    rows = []
    for f, lim, rr in zip(fractions, limits, runs):
        ok = [r for r in rr if r.get("tg_tps")]
        best = max(ok, key=lambda r: r["tg_tps"]) if ok else rr[-1]
        rows.append({"fraction": f, **best, "limit": lim, "runs_tps": [r.get("tg_tps") for r in rr]})
    base = rows[0].get("tg_tps") if fractions and fractions[0] is None else None
    for r in rows:
        r["slowdown"] = round(base / r["tg_tps"], 1) if base and r.get("tg_tps") else None
    experts = sum(t.nbytes for t in h.tensors if P._EXPERTS.match(t.name))
    return {"model": model.name, "file_bytes": weights, "expert_bytes": experts, "n_gen": n_gen, "threads": threads,
            "rounds": rounds, "anon": anon, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


# --- all cases ---------------------------------------------------------------------------------------

def default_cases(workdir: Path, progress: Callable[[str], None] = print) -> list[Case]:
    smol, gemma = assets.model_path("smollm2-135m"), assets.model_path("gemma3-270m")
    return [Case("smollm2-135m", smol, 4096, "f16"),
            Case("gemma3-270m", gemma, 4096, "isoquant3_0"),
            Case("qwen2.5-coder-1.5b", assets.model_path("qwen2.5-coder-1.5b"), 4096, "q8_0/isoquant3_0"),
            Case("qwen2moe-synthetic", synthetic_moe(workdir, progress=progress), 4096, "q8_0"),
            Case("smollm2-135m 4 slots", smol, 1024, "q8_0", parallel=4),
            Case("smollm2-135m deferred", smol, 4096, "q8_0", deferred=True),
            Case("gemma3-270m deferred", gemma, 4096, "isoquant3_0", deferred=True)]


def main_verify(args: argparse.Namespace) -> int:
    stem = args.out or RESULTS / ("plan-verify" if not args.model else f"plan-verify-{Path(args.model[0]).stem}")
    with tempfile.TemporaryDirectory(prefix="rq-plan-verify-") as tmp:
        wd = Path(tmp)
        if args.model:
            kv = (args.kv or "f16").split(",")[0]
            cases = [Case(Path(m).name, Path(m), args.ctx or 4096, kv, deferred=args.deferred) for m in args.model]
        else:
            cases = default_cases(wd)
        rows = [measure(c) for c in cases]
        moe, paging, timing = [], None, None
        if not args.model:
            model = next(c.model for c in cases if c.name == "qwen2moe-synthetic")
            h = P.read_header(model)
            experts = sum(t.nbytes for t in h.tensors if P._EXPERTS.match(t.name))
            moe.append(check_expert_rules(model, vram=h.data_bytes - experts // 2))
            try:
                paging = paging_experiment(synthetic_moe(wd, recipe="f16"), fractions=(None, 0.75, 0.5, 0.25))
            except (VerifyError, OSError) as e:
                print(f"[rq-plan verify] paging experiment skipped: {e}")
            qwen = assets.model_path("qwen2.5-coder-1.5b")
            t0 = time.perf_counter()
            p = subprocess.run([str(paths.venv_dir() / "bin" / "rq-plan"), str(qwen), "--budget", "2G", "--ctx",
                                "32768", "--json"], capture_output=True, text=True, check=False)
            timing = {"model": qwen.name, "budget": "2G", "ctx": 32768, "seconds": round(time.perf_counter() - t0, 2),
                      "candidates": len(json.loads(p.stdout)["candidates"]) if p.returncode == 0 else None}
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.describe(), "tolerance": TOLERANCE,
           "rows": rows, "moe": moe, "paging": paging, "timing": timing}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = to_markdown(res)
    stem.with_suffix(".md").write_text(md)
    print(md)
    bad = [r["case"] for r in rows if not r["within"] and not r.get("deferred")] + \
        [x["case"] for x in moe if not x["match"]]
    if bad:
        print(f"rq-plan --verify: outside ±{100 * TOLERANCE:.0f}% or mismatched: {', '.join(bad)}")
        return 1
    return 0
