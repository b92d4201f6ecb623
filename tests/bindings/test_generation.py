"""End to end on the default model: llama_cpp.Llama and the patched programs agree; the server serves."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

PROMPT = "The capital of France is"
N = 16

pytestmark = pytest.mark.slow


def _cli_tokens(bin_dir, model, prompt, n, extra=()):
    """Greedy continuation from llama-completion, as text."""
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0",
           "-no-cnv", "-t", "2", "-c", "512", "--no-warmup", "--no-display-prompt", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_llama_cpp_and_cli_agree_greedy(bin_dir, smollm2):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(smollm2), n_ctx=512, n_threads=2, seed=42, verbose=False)
    out = llm.create_completion(PROMPT, max_tokens=N, temperature=0.0, top_k=1)
    py_text = out["choices"][0]["text"]
    cli_text = _cli_tokens(bin_dir, smollm2, PROMPT, N)
    assert py_text.strip(), "empty generation"
    assert cli_text.strip().startswith(py_text.strip()[:40]), (py_text, cli_text)
    # same greedy tokens, not only the same prefix text
    assert llm.tokenize(cli_text.encode(), add_bos=False)[:8] == llm.tokenize(py_text.encode(), add_bos=False)[:8]


def test_server_health_and_completion(bin_dir, smollm2, free_port):
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(smollm2), "--host", "127.0.0.1",
                             "--port", str(free_port), "-c", "512", "-t", "2", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{free_port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200 and json.loads(r.read()).get("status") == "ok":
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(0.5)
        req = urllib.request.Request(base + "/completion", method="POST",
                                     data=json.dumps({"prompt": PROMPT, "n_predict": 8, "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        assert r.status == 200 and body["content"].strip()
    finally:
        proc.terminate()
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, f"llama-server exited with {rc} on SIGTERM"
