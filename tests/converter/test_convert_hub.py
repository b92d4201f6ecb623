"""Repo ids go through huggingface_hub: the local cache first; offline and not cached -> a clear error
naming the cache path and HF_HUB_OFFLINE. (No hub is reachable here: the cache is built by the test.)"""

from __future__ import annotations

import os
import subprocess
import sys


def _run(args, env_extra, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "rotaryquant.converter.cli", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_offline_repo_not_in_cache(tmp_path):
    cache = tmp_path / "hub"
    p = _run(["someorg/some-model", tmp_path / "o.gguf"], {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert p.returncode == 1
    err = p.stderr.strip()
    assert err.count("\n") == 0, err
    assert "'someorg/some-model' is not in the Hugging Face cache at" in err and str(cache) in err
    assert "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "o.gguf").exists()


def test_repo_id_resolved_from_the_cache(smol2_hf, tmp_path, h):
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--rq-test--smollm2-2L"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in smol2_hf.iterdir():
        (snap / f.name).symlink_to(f)
    out = tmp_path / "o.gguf"
    p = _run(["rq-test/smollm2-2L", out, "--recipe", "q8_0"], {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert h.fields(out)["rotaryquant.converter.recipe"] == "q8_0"
