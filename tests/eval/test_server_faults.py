"""llama-server (patched) under faults, nothing lost: clients that disconnect mid-stream, a prompt cancelled while
deferred prefill holds its F16 rows, a prompt longer than the context, and slot files that cannot be restored.
Each checks what the others kept: their answers, the slot's state, the transient memory."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from rotaryquant.eval import serve

pytestmark = pytest.mark.slow

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)   # ~440 tokens of Gemma3
STORY = {"prompt": "The three most important inventions of the nineteenth century were", "n_predict": 12,
         "temperature": 0, "top_k": 1, "id_slot": 0, "cache_prompt": True}


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _idle(base: str, timeout: float = 60) -> dict[str, float]:
    """Wait until no slot is processing; then the deferred-prefill gauges."""
    end = time.time() + timeout
    while True:
        busy = serve.busy_slots(base)
        if not busy:
            return {k: v for k, v in serve.metrics(base).items() if k.startswith("kv_deferred")}
        assert time.time() < end, f"slots {busy} still processing {timeout:.0f} s after their clients left"
        time.sleep(0.5)


def test_half_of_eight_streaming_clients_disconnect(gemma3):
    """Deterministic server (batch-invariant kernels), 8 slots, deferred prefill: the 4 clients that stay get
    what they get alone; the 4 that leave mid-stream (2 after some tokens, 2 during their prompt) free their
    slots and their F16 rows."""
    keep = [serve.Request(p, "completion-stream", 24) for p in serve.PROMPTS[:4]]
    with serve.server(gemma3, cache="isoquant3_0", parallel=8, ctx_per_slot=512,
                      extra=[*serve.DETERMINISTIC_ARGS, "--kv-deferred"], env=serve.DETERMINISTIC_ENV) as srv:
        alone = [serve.send(srv.url, r) for r in keep]
        assert all(a.status == 200 and a.text.strip() for a in alone), alone
        got: dict[int, serve.Response] = {}

        def keeper(i: int) -> None:
            got[i] = serve.send(srv.url, keep[i])

        ts = [threading.Thread(target=keeper, args=(i,)) for i in range(4)]
        ts += [threading.Thread(target=serve.stream_and_drop, args=(srv.url, f"{LONG} {i}", events),
                                kwargs={"n_predict": 64}) for i, events in enumerate((3, 3, 0, 0))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
        assert [got[i].text for i in range(4)] == [a.text for a in alone]
        m = _idle(srv.url)
        assert m["kv_deferred_bytes"] == 0, m
        assert m["kv_deferred_peak_bytes"] > 0       # the long prompts did hold F16 rows
        assert serve.send(srv.url, keep[0]).text == alone[0].text


def test_prompt_cancelled_during_deferred_prefill_gives_its_rows_back(gemma3):
    # 64-token batches: the prompt takes several steps, and the client leaves after some of them
    with serve.server(gemma3, cache="isoquant3_0", parallel=2, ctx_per_slot=512,
                      extra=["--kv-deferred", "-b", "64", "-ub", "64"]) as srv:
        short = {"prompt": "Hello, my name is", "n_predict": 8, "temperature": 0, "cache_prompt": False}
        before = _post(srv.url, "/completion", short)[1]["content"]
        serve.stream_and_drop(srv.url, LONG, 0, n_predict=64, in_prompt=True)
        m = _idle(srv.url)
        assert m["kv_deferred_peak_bytes"] > 0 and m["kv_deferred_bytes"] == 0, m
        assert _post(srv.url, "/completion", short)[1]["content"] == before


def test_prompt_longer_than_the_context_is_refused_and_the_server_goes_on(gemma3):
    with serve.server(gemma3, cache="isoquant3_0", parallel=1, ctx_per_slot=512) as srv:
        st, r = _post(srv.url, "/completion", {"prompt": LONG * 3, "n_predict": 8})
        assert st == 400 and r["error"]["type"] == "exceed_context_size_error", r
        assert "exceeds the available context size (512 tokens)" in r["error"]["message"]
        st, r = _post(srv.url, "/completion", {"prompt": "Hello, my name is", "n_predict": 8})
        assert st == 200 and r["content"].strip()


def test_failed_slot_restores_keep_the_slot(gemma3, tmp_path):
    """Missing, truncated, not-a-slot-file and other-cache-type files: a 400 that names the problem, and the slot
    keeps its cells (the same prompt is served from them, with the same text)."""
    with serve.server(gemma3, cache="f16", parallel=1, ctx_per_slot=512,
                      extra=["--slot-save-path", str(tmp_path), "--swa-full"]) as srv:
        _post(srv.url, "/completion", STORY)
        assert _post(srv.url, "/slots/0?action=save", {"filename": "f16.bin"})[0] == 200
    with serve.server(gemma3, cache="isoquant3_0", parallel=1, ctx_per_slot=512,
                      extra=["--slot-save-path", str(tmp_path), "--swa-full"]) as srv:
        _post(srv.url, "/completion", STORY)
        warm = _post(srv.url, "/completion", STORY)[1]       # served from the slot's cells: what a kept slot gives
        assert warm["timings"]["cache_n"] > 0
        st, saved = _post(srv.url, "/slots/0?action=save", {"filename": "iso.bin"})
        assert st == 200 and saved["n_saved"] > 0
        data = (tmp_path / "iso.bin").read_bytes()
        (tmp_path / "trunc.bin").write_bytes(data[:len(data) // 2])
        (tmp_path / "magic.bin").write_bytes(b"XXXX" + data[4:])
        # the payload only: header and length intact, so without the checksum this restored silently
        assert data[-4:] == b"rqsm", "slot files end with their checksum"
        mid = len(data) // 2
        (tmp_path / "corrupt.bin").write_bytes(data[:mid] + bytes(b ^ 0x5A for b in data[mid:mid + 64]) + data[mid + 64:])
        for name, why in (("missing.bin", "no slot file 'missing.bin'"), ("trunc.bin", "is not a slot file"),
                          ("magic.bin", "is not a slot file"), ("f16.bin", "is not a slot file"),
                          ("corrupt.bin", "corrupted")):
            st, r = _post(srv.url, "/slots/0?action=restore", {"filename": name})
            assert st == 400 and why in r["error"]["message"] and "keeps its state" in r["error"]["message"], r
            again = _post(srv.url, "/completion", STORY)[1]
            assert again["content"] == warm["content"], name
            assert again["timings"]["cache_n"] == warm["timings"]["cache_n"], (name, again["timings"])
        assert "iso/corrupt.bin is corrupted" in srv.log.read_text().replace(str(tmp_path), "iso")
        # and a good file still restores, as does one without the checksum (another build's)
        (tmp_path / "unsealed.bin").write_bytes(data[:-12])
        for name in ("iso.bin", "unsealed.bin"):
            st, r = _post(srv.url, "/slots/0?action=restore", {"filename": name})
            assert st == 200 and r["n_restored"] == saved["n_saved"], (name, r)
            assert _post(srv.url, "/completion", STORY)[1]["content"] == warm["content"], name


def test_rpc_worker_killed_mid_generation(gemma3):
    """All layers on a loopback ggml-rpc-server that is killed while a client streams: that client gets an error
    event, llama-server stays up (health, tokenize), later completions get the same clear error at once, and the
    log names the lost worker. (What the worker held is gone: only a restart with a worker serves again.)"""
    with serve.rpc_worker(threads=1) as (endpoint, worker):
        with serve.server(gemma3, cache="isoquant3_0", parallel=2, ctx_per_slot=512,
                          extra=["--rpc", endpoint, "-ngl", "99"]) as srv:
            st, ok = _post(srv.url, "/completion", {"prompt": "Hello, my name is", "n_predict": 4})
            assert st == 200 and ok["content"], ok
            events = _stream_then(srv.url, {"prompt": STORY["prompt"], "n_predict": 400, "stream": True},
                                  after=4, action=worker.kill)
            assert json.loads(events[-1])["error"]["message"].startswith("Compute error"), events[-3:]
            assert len(events) < 400, "the stream ran to its end after the worker was killed"
            assert _get(srv.url, "/health")[0] == 200
            assert _post(srv.url, "/tokenize", {"content": "still here"})[1]["tokens"]
            st, r = _post(srv.url, "/completion", {"prompt": "Hello", "n_predict": 4})
            assert st == 500 and "backend failed" in r["error"]["message"], r
            assert f"RPC worker {endpoint} lost" in srv.log.read_text()
            assert serve.busy_slots(srv.url) == []


def _get(base: str, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.status, r.read()


def _stream_then(base: str, body: dict, *, after: int, action) -> list[str]:
    """The data lines of a streamed completion; ``action`` runs once ``after`` of them have arrived."""
    req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events: list[str] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == after:
                    action()
    return events
