"""scripts/peers/build.sh, the peers' build for `rq-eval versus`: its refusals (no peer source is needed for them) and
what it hands CMake, on a stand-in tree whose CMakeLists only records the options and the targets asked for."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "peers" / "build.sh"


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_help_explains_usage() -> None:
    r = _run("--help")
    assert r.returncode == 0
    assert "scripts/peers/build.sh SRC NAME" in r.stdout and "build/peers/NAME/bin" in r.stdout


def test_refuses_missing_source(tmp_path: Path) -> None:
    r = _run(str(tmp_path / "absent"), "ik")
    assert r.returncode != 0 and "no source folder" in r.stderr


def test_refuses_a_folder_that_is_not_llama_cpp(tmp_path: Path) -> None:
    r = _run(str(tmp_path), "ik")
    assert r.returncode != 0 and "not a llama.cpp source tree" in r.stderr


def test_refuses_a_name_with_a_path(tmp_path: Path) -> None:
    (tmp_path / "ggml").mkdir()
    (tmp_path / "CMakeLists.txt").write_text("")
    r = _run(str(tmp_path), "../x")
    assert r.returncode != 0 and "plain folder name" in r.stderr


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_configures_with_our_cpu_options_and_skips_missing_targets(tmp_path: Path) -> None:
    """A stand-in tree with two of the tools: the script must pass the x86-64-v3 options, build what exists and name
    what it skipped. The build folder is build/peers/NAME under a copy of the script's repository layout."""
    src = tmp_path / "src"
    (src / "ggml").mkdir(parents=True)
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(standin C)\n"
        'file(WRITE "${CMAKE_BINARY_DIR}/options.txt" "AVX2=${GGML_AVX2} NATIVE=${GGML_NATIVE} '
        'AVX512=${GGML_AVX512} SHARED=${BUILD_SHARED_LIBS} TYPE=${CMAKE_BUILD_TYPE}")\n'
        "add_executable(llama-perplexity main.c)\nadd_executable(llama-quantize main.c)\n"
    )
    repo = tmp_path / "repo"
    (repo / "scripts" / "peers").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "peers" / "build.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCACHE")}
    r = subprocess.run(["bash", str(repo / "scripts" / "peers" / "build.sh"), str(src), "standin"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = repo / "build" / "peers" / "standin"
    assert (out / "options.txt").read_text() == "AVX2=ON NATIVE=OFF AVX512=OFF SHARED=ON TYPE=Release"
    assert (out / "llama-perplexity").exists() and (out / "llama-quantize").exists()
    assert "has no target llama-bench: skipped" in r.stdout
    assert "has no target llama-imatrix: skipped" in r.stdout
