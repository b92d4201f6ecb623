"""llama-server under load, on loopback only: concurrency, correctness, throughput, soak.

The RotaryQuant authors' own server returned empty bodies with HTTP 200 for 4 of 8 concurrent
clients and reached 34% parallel efficiency. This drives the patched upstream llama-server with
N concurrent clients (completion and chat, streaming and not) and checks every response against
the same request sent alone: no failures, no empty bodies, identical greedy text. Every loop is
bounded in requests and time; the server is stopped at the end.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rotaryquant import kvtypes
from rotaryquant.bindings import tools
from rotaryquant.errors import RQError

PROMPTS = (
    "Write two sentences about the sea.",
    "List three uses of copper.",
    "Explain what a prime number is.",
    "Describe a winter morning in a small town.",
    "Give a short definition of entropy.",
    "What does a compiler do?",
    "Name three birds that cannot fly.",
    "Summarise the plot of a detective story in two sentences.",
)
KINDS = ("completion", "completion-stream", "chat", "chat-stream")

# Batch-invariant serving: upstream CPU kernels that switch algorithm with the number of rows in a
# ubatch round differently, so a request's tokens depend on what else the server batched with it.
# Two do it on x86: the repacked Q4_0/Q4_K/IQ4_NL weights (GEMM from 4 rows, GEMV below) and the
# tiled K-quant matmul (from 8 rows). Turning both off makes every greedy response under load
# identical to the same request alone (measured; docs/NOTES.md), at a prefill-speed cost.
DETERMINISTIC_ARGS = ("--no-repack",)
DETERMINISTIC_ENV = {"GGML_CPU_TILED_MM": "0"}


class ServeError(RQError):
    """The server did not start, or a bounded step ran out of time."""


@dataclass(frozen=True)
class Request:
    prompt: str
    kind: str
    n_predict: int

    @property
    def key(self) -> tuple[str, str]:
        return self.prompt, self.kind


@dataclass
class Response:
    request: Request
    status: int
    text: str
    n_tokens: int
    seconds: float
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    log: Path | None = None


@contextmanager
def launch(cmd: list[str], *, env: dict[str, str] | None = None, start_timeout: float = 180,
           error: type[Exception] = None, web_ui: bool = False) -> Iterator[tuple[str, int, Path]]:
    """Start llama-server `cmd` (without host/port) on a free loopback port; yield (url, pid, log file); stop it
    (SIGTERM, then kill) and remove the log. Switches inherited from the environment are dropped. The web UI is
    off unless ``web_ui``."""
    error = error or ServeError
    port = free_port()
    full = [*cmd, "--host", "127.0.0.1", "--port", str(port), *(() if web_ui else ("--no-webui",))]
    e = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ISOQUANT_", "GGML_ISOQUANT_", "LLAMA_ARG_"))}
    e.update(env or {})
    # the log goes to a file: an unread pipe fills up (64 KiB) and then blocks the server's main loop,
    # which the 30-minute soak found
    log = tempfile.NamedTemporaryFile("w+", prefix="rq-llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, text=True, env=e)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + start_timeout
        while True:
            if proc.poll() is not None:
                log.flush()
                raise error(f"llama-server exited with {proc.returncode}: {Path(log.name).read_text()[-1500:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.HTTPError):
                pass
            if time.time() > deadline:
                raise error(f"llama-server did not become healthy within {start_timeout:.0f} s")
            time.sleep(0.3)
        yield base, proc.pid, Path(log.name)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        Path(log.name).unlink(missing_ok=True)


@contextmanager
def rpc_worker(threads: int = 2, start_timeout: float = 30) -> Iterator[tuple[str, subprocess.Popen]]:
    """A ggml-rpc-server on a free loopback port (a CPU backend llama sees as a GPU-type device): yield its
    endpoint and process (tests kill it); stopped afterwards."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: an unread pipe would block a chatty worker
    proc = subprocess.Popen([str(tools.binary("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t",
                             str(threads)], stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        deadline = time.time() + start_timeout
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                log.seek(0)
                raise ServeError(f"ggml-rpc-server exited with {proc.returncode}: {log.read()[-1500:]}")
            if time.time() > deadline:
                raise ServeError(f"ggml-rpc-server did not listen within {start_timeout:.0f} s")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()
        log.close()


@contextmanager
def server(model: Path, *, cache: str = "isoquant3_0", parallel: int = 8, ctx_per_slot: int = 512, threads: int = 2,
           extra: list[str] | None = None, env: dict[str, str] | None = None,
           start_timeout: float = 180) -> Iterator[Server]:
    """llama-server for `model` with `parallel` slots and a cache spec (see kvtypes)."""
    k, v = kvtypes.split(cache)
    cmd = [str(tools.binary("llama-server")), "-m", str(model), "-c", str(ctx_per_slot * parallel),
           "--parallel", str(parallel), "-t", str(threads), "-fa", "on", "-ctk", k, "-ctv", v, "--metrics",
           *(extra or [])]
    if not kvtypes.k_center(cache):
        cmd.append("--no-k-center")
    if kvtypes.layer_types(cache):
        cmd += ["--kv-layer-types", kvtypes.layer_types(cache)]
    cmd += ["--kv-window", str(kvtypes.window(cache))]  # the spec's, 0 included: not the runtime's default
    with launch(cmd, env=env, start_timeout=start_timeout) as (base, pid, log):
        yield Server(base, pid, log)


def _post(url: str, body: dict, timeout: float) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def send(base: str, req: Request, timeout: float = 300) -> Response:
    """One request; streaming responses are reassembled from their server-sent events."""
    stream = req.kind.endswith("-stream")
    common = {"temperature": 0.0, "top_k": 1, "seed": 42, "cache_prompt": False, "stream": stream}
    if req.kind.startswith("completion"):
        url, body = base + "/completion", {"prompt": req.prompt, "n_predict": req.n_predict, **common}
    else:
        url, body = base + "/v1/chat/completions", {"messages": [{"role": "user", "content": req.prompt}],
                                                    "max_tokens": req.n_predict, **common}
    t0 = time.time()
    try:
        with urllib.request.urlopen(_post(url, body, timeout), timeout=timeout) as r:
            status = r.status
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        return Response(req, e.code, "", 0, time.time() - t0, f"HTTP {e.code}: {e.read()[:200]!r}")
    except OSError as e:
        return Response(req, 0, "", 0, time.time() - t0, str(e))
    text, n_tok = _parse(req, raw, stream)
    return Response(req, status, text, n_tok, time.time() - t0, "" if raw.strip() else "empty body")


def _parse(req: Request, raw: str, stream: bool) -> tuple[str, int]:
    chat = req.kind.startswith("chat")
    if not stream:
        if not raw.strip():
            return "", 0
        j = json.loads(raw)
        if chat:
            return j["choices"][0]["message"]["content"] or "", int(j.get("usage", {}).get("completion_tokens", 0))
        return j.get("content", ""), int(j.get("tokens_predicted", 0))
    text, n = [], 0
    for line in raw.splitlines():
        if not line.startswith("data: ") or line.strip() == "data: [DONE]":
            continue
        j = json.loads(line[6:])
        if chat:
            if j.get("choices") and j["choices"][0].get("delta", {}).get("content"):
                text.append(j["choices"][0]["delta"]["content"])
                n += 1
            if j.get("usage"):
                n = int(j["usage"].get("completion_tokens", n))
        else:
            text.append(j.get("content", ""))
            if j.get("stop"):
                n = int(j.get("tokens_predicted", n))
    return "".join(text), n


def proc_status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile, ...), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.rstrip().endswith("kB"):
            out[name] = int(value.split()[0]) * 1024
    return out


def proc_status_mib(pid: int) -> dict[str, float]:
    """proc_status in MiB."""
    return {k: round(v / 2**20, 1) for k, v in proc_status(pid).items()}


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line.partition(" ")
                out[name.split(":", 1)[1]] = float(value)
        return out


def requests_for(n_requests: int, n_predict: int) -> list[Request]:
    return [Request(PROMPTS[i % len(PROMPTS)], KINDS[(i // len(PROMPTS)) % len(KINDS)], n_predict)
            for i in range(n_requests)]


@dataclass
class LoadResult:
    cache: str
    clients: int
    requests: int
    failures: int
    empty: int
    mismatches: int
    solo_tps: float
    concurrent_tps: float
    parallel_efficiency: float
    solo_seconds: float
    concurrent_seconds: float
    metrics: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)
    server_args: list = field(default_factory=list)
    deterministic: bool = False
    rss_mib: dict = field(default_factory=dict)  # the server's VmRSS before and after the load, VmHWM


def load_test(model: Path, *, cache: str = "isoquant3_0", clients: int = 8, per_client: int = 4, n_predict: int = 32,
              threads: int = 2, server_args: list[str] | None = None, deterministic: bool = False,
              deadline_s: float = 1800, progress=print) -> LoadResult:
    """Every distinct request alone, then `clients` concurrent clients; compares the two, counts failures."""
    reqs = requests_for(clients * per_client, n_predict)
    distinct = list({r.key: r for r in reqs}.values())
    args = [*(server_args or []), *(DETERMINISTIC_ARGS if deterministic else ())]
    mode = "deterministic" if deterministic else "default"
    with server(model, cache=cache, parallel=clients, threads=threads, extra=args,
                env=DETERMINISTIC_ENV if deterministic else None) as srv:
        base = srv.url
        rss_before = proc_status_mib(srv.pid)["VmRSS"]
        progress(f"[rq-eval serve] {cache} ({mode}): {len(distinct)} distinct requests alone")
        t0 = time.time()
        solo = {r.key: send(base, r) for r in distinct}
        solo_s = time.time() - t0
        solo_tokens = sum(r.n_tokens for r in solo.values())
        progress(f"[rq-eval serve] {cache} ({mode}): {clients} clients x {per_client} requests")
        results: list[Response] = []
        lock = threading.Lock()
        stop_at = time.time() + deadline_s

        def client(i: int) -> None:
            for r in reqs[i::clients]:
                if time.time() > stop_at:
                    return
                resp = send(base, r)
                with lock:
                    results.append(resp)

        t0 = time.time()
        threads_ = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        conc_s = time.time() - t0
        m = metrics(base)
        st = proc_status_mib(srv.pid)
        rss = {"before": rss_before, "after": st["VmRSS"], "peak": st["VmHWM"]}
    if len(results) != len(reqs):
        raise ServeError(f"only {len(results)} of {len(reqs)} requests finished within {deadline_s:.0f} s")
    failures = sum(1 for r in results if r.status != 200 or r.error)
    empty = sum(1 for r in results if r.status == 200 and not r.text.strip())
    mism = [r for r in results if r.text != solo[r.request.key].text]
    conc_tokens = sum(r.n_tokens for r in results)
    solo_tps = solo_tokens / solo_s if solo_s else 0.0
    conc_tps = conc_tokens / conc_s if conc_s else 0.0
    return LoadResult(cache, clients, len(results), failures, empty, len(mism), round(solo_tps, 2), round(conc_tps, 2),
                      round(conc_tps / (clients * solo_tps), 3) if solo_tps else 0.0, round(solo_s, 1), round(conc_s, 1),
                      {k: v for k, v in m.items() if k.startswith(("isoquant", "kv_deferred"))},
                      [{"kind": r.request.kind, "prompt": r.request.prompt, "alone": solo[r.request.key].text,
                        "concurrent": r.text} for r in mism[:3]], list(server_args or []), deterministic, rss)


def mixed_requests(n_requests: int) -> list[Request]:
    """Prompts of 1-8 repetitions of the PROMPTS and 16-96 new tokens, over every kind: the soak's mix."""
    out = []
    for i in range(n_requests):
        reps = 1 + (i * 5) % 8
        prompt = " ".join(PROMPTS[(i + j) % len(PROMPTS)] for j in range(reps))
        out.append(Request(prompt, KINDS[i % len(KINDS)], (16, 48, 96)[(i // 3) % 3]))
    return out


def busy_slots(base: str) -> list[int]:
    """The ids of the slots processing a task now (/slots)."""
    with urllib.request.urlopen(base + "/slots", timeout=10) as r:
        return [s["id"] for s in json.loads(r.read()) if s.get("is_processing")]


def stream_and_drop(base: str, prompt: str, events: int, *, n_predict: int = 96, in_prompt: bool = False,
                    timeout: float = 60) -> None:
    """A streaming completion whose client reads ``events`` server-sent events and then closes its socket; with
    ``in_prompt``, it leaves while the server processes the prompt (meant for the only request in flight)."""
    host, port = base.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request("POST", "/completion", json.dumps({"prompt": prompt, "n_predict": n_predict, "stream": True}),
                  {"Content-Type": "application/json"})
        if in_prompt:
            end = time.time() + 30
            while not busy_slots(base) and time.time() < end:
                time.sleep(0.02)
            time.sleep(0.3)   # a few of its batches in
        if events:
            r = c.getresponse()
            seen = 0
            while seen < events:
                line = r.fp.readline()
                if not line:
                    break
                seen += line.startswith(b"data: ")
    finally:
        c.close()


def soak(model: Path, *, cache: str = "isoquant3_0", minutes: float = 30, clients: int = 4, n_predict: int = 48,
         threads: int = 2, sample_every_s: float = 15, stall_s: float = 120, mixed: bool = False,
         disconnect_every: int = 0, extra: list[str] | None = None, progress=print) -> dict:
    """Requests for `minutes`; RSS of the server sampled; every response checked for well-formedness. ``mixed``:
    prompt and answer lengths vary (:func:`mixed_requests`); ``disconnect_every`` N: every Nth request of a client
    is a stream it leaves after a few tokens (checked afterwards: no slot left processing, no deferred rows
    held); ``extra``: more llama-server arguments (e.g. ``--cache-ram 0``)."""
    reqs = mixed_requests(64) if mixed else requests_for(64, n_predict)
    samples: list[tuple[float, int]] = []
    bad: list[str] = []
    done = dropped = 0
    stalled = False
    with server(model, cache=cache, parallel=clients, threads=threads, extra=extra) as srv:
        base, pid = srv.url, srv.pid
        end = time.time() + 60 * minutes
        lock = threading.Lock()

        def client(i: int) -> None:
            nonlocal done, dropped
            k = i
            while time.time() < end:
                req = reqs[k % len(reqs)]
                k += clients
                if disconnect_every and (k // clients) % disconnect_every == 0:
                    try:
                        stream_and_drop(base, req.prompt, 1 + k % 5)
                    except OSError as e:
                        with lock:
                            bad.append(f"dropped stream: {e}")
                    with lock:
                        dropped += 1
                    continue
                r = send(base, req)
                with lock:
                    done += 1
                    if r.status != 200 or r.error or not r.text.strip():
                        bad.append(f"{r.request.kind}: status {r.status} {r.error or 'empty'}")

        ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in ts:
            t.start()
        t0 = time.time()
        last_done, last_change = -1, t0
        while any(t.is_alive() for t in ts):
            samples.append((round(time.time() - t0, 1), _rss_kib(pid)))
            progress(f"[rq-eval soak] {samples[-1][0]:.0f} s: {done} requests, {dropped} dropped, "
                     f"RSS {samples[-1][1] / 1024:.0f} MiB")
            if done != last_done:
                last_done, last_change = done, time.time()
            elif time.time() - last_change > stall_s:
                # no request finished for stall_s: the server hangs; stop the clients (their requests time out)
                stalled = True
                end = time.time()
                bad.append(f"no request finished for {stall_s:.0f} s after {done} requests")
                break
            time.sleep(sample_every_s)
        for t in ts:
            t.join(timeout=330)
        after = _settled(base)
    # buffers are touched during the first minute (warm-up); growth is judged on what follows
    warm = [x for x in samples if x[0] >= min(60.0, 6 * minutes)] or samples
    half = len(warm) // 2
    first = sum(s for _, s in warm[:half]) / max(1, half)
    second = sum(s for _, s in warm[half:]) / max(1, len(warm) - half)
    return {"cache": cache, "minutes": minutes, "requests": done, "dropped": dropped, "malformed": len(bad),
            "stalled": stalled, "examples": bad[:5], "mixed": mixed, "server_args": list(extra or []),
            "after": after, "rss_kib": samples,
            "rss_growth_pct": round(100 * (second - first) / first, 2) if first else 0.0}


def soak_markdown(res: dict) -> str:
    rss = res["rss_kib"]
    args = " ".join(res.get("server_args", [])) or "default"
    return "\n".join([
        f"# llama-server soak: {res['cache']}, {args}", "",
        f"{res['minutes']:g} minutes, {'mixed prompt/answer lengths' if res.get('mixed') else 'fixed lengths'}; "
        f"RSS sampled every 15 s; growth = mean of the second half of the samples after the first minute over the "
        f"first half.", "",
        "| requests | dropped by client | malformed | stalled | RSS first / last (MiB) | growth | slots busy after "
        "| deferred bytes after |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
        f"| {res['requests']} | {res.get('dropped', 0)} | {res['malformed']} | {'yes' if res['stalled'] else 'no'} "
        f"| {rss[0][1] / 1024:.0f} / {rss[-1][1] / 1024:.0f} | {res['rss_growth_pct']}% "
        f"| {res.get('after', {}).get('slots_processing', '-')} | {res.get('after', {}).get('kv_deferred_bytes', '-')} |",
        "",
    ])


def _settled(base: str, timeout: float = 60) -> dict:
    """Once the clients are gone: slots still processing and deferred rows still held (both should be 0)."""
    end = time.time() + timeout
    while True:
        try:
            busy = busy_slots(base)
        except (OSError, ValueError):
            busy = []
        if not busy or time.time() > end:
            m = metrics(base)
            return {"slots_processing": len(busy), "kv_deferred_bytes": m.get("kv_deferred_bytes", 0.0)}
        time.sleep(0.5)


def _rss_kib(pid: int) -> int:
    return proc_status(pid).get("VmRSS", 0) // 1024


def to_markdown(results: list[dict]) -> str:
    lines = ["## llama-server under load", "",
             "Greedy requests (completion and chat, streaming and not) on loopback; 'identical' compares each "
             "concurrent response with the same request sent alone; efficiency = concurrent t/s / (clients x alone t/s).", "",
             "| cache | mode | server args | clients | requests | failures | empty | differ from alone | alone t/s | concurrent t/s | efficiency | fused calls | dequant rows |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        m = r.get("metrics", {})
        mode = "deterministic" if r.get("deterministic") else "default"
        lines.append(f"| {r['cache']} | {mode} | {' '.join(r.get('server_args', [])) or '-'} | {r['clients']} | {r['requests']} | {r['failures']} | {r['empty']} | {r['mismatches']} "
                     f"| {r['solo_tps']:.1f} | {r['concurrent_tps']:.1f} | {r['parallel_efficiency']:.2f} "
                     f"| {m.get('isoquant_fused_calls_total', 0):.0f} | {m.get('isoquant_dequant_rows_total', 0):.0f} |")
    mem = [r for r in results if r.get("rss_mib")]
    if mem:
        lines += ["", "Server memory (VmRSS before the first request and after the load, VmHWM) and the deferred-prefill "
                  "transient (llama-server /metrics):", "",
                  "| cache | server args | RSS before MiB | RSS after MiB | peak MiB | transient peak MiB | transient after |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in mem:
            m, rs = r.get("metrics", {}), r["rss_mib"]
            lines.append(f"| {r['cache']} | {' '.join(r.get('server_args', [])) or '-'} | {rs['before']:.0f} | {rs['after']:.0f} "
                         f"| {rs['peak']:.0f} | {m.get('kv_deferred_peak_bytes', 0) / 2**20:.1f} "
                         f"| {m.get('kv_deferred_bytes', 0):.0f} B |")
    return "\n".join(lines) + "\n"


def as_dict(r: LoadResult) -> dict:
    return asdict(r)
