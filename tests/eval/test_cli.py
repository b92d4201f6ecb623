"""rq-eval / rq-bench command lines: bad arguments are one clear line and a non-zero exit; every
subcommand is listed with what it measures and where its result goes, and its own --help works."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from rotaryquant.eval import cli

REPO = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("args, message", [
    (["ppl", "--kv", "q8_0,isoquant9"], "unknown ggml type 'isoquant9'"),
    (["niah", "--model", "/nonexistent.gguf"], "does not exist"),
    (["gate", "--kv", "f17"], "unknown ggml type 'f17'"),
    (["bench", "--types", "f16,q9_9"], "unknown ggml type 'q9_9'"),
    (["bench", "--model", "/nonexistent.gguf"], "does not exist"),
    (["bench", "--model", "/nonexistent.gguf", "--depths", "0,2k"], "--depths takes comma-separated integers"),
    (["convert-speed", "--models", "smollm3"], "unknown model 'smollm3'"),
    (["convert-speed", "--inputs", "hf,safetensors"], "unknown input 'safetensors'"),
    (["convert-speed", "--recipes", "rotaryquant,bf16"], "no upstream counterpart for recipe 'bf16'"),
    (["convert-speed", "--layers", "0"], "layers must be at least 1"),
    (["isoquant-variants", "--vectors", "100"], "at least 256 vectors"),
    (["weights", "--only", "IQ3_S,Q9_K"], "--only: unknown variant(s) Q9_K"),
    (["weights", "--merge", "-o", "/nonexistent/weights"], "--merge: /nonexistent/weights.json does not exist"),
    (["versus", "--config", "ours:f16", "--measure", "niah", "--needles", "9"], "--needles 9: a haystack holds 1 to 8"),
    (["versus", "--config", "ours:f16", "--measure", "niah", "--resume"], "--resume continues the needles"),
])
def test_bad_arguments(args, message, capsys):
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("rq-eval: error: ") and message in err
    assert "Traceback" not in err


def test_bad_arguments_in_a_process():
    proc = _run("rotaryquant.eval.cli", "ppl", "--kv", "q8_0,isoquant9")
    assert proc.returncode == 1
    assert "unknown ggml type 'isoquant9'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_every_subcommand_with_its_result():
    ap, subs = cli.build_parser()
    text = ap.format_help()
    lines = text.splitlines()
    assert set(subs) >= {"bench", "ppl", "decode", "memory", "ablation", "niah", "gate", "weights", "serve", "soak",
                         "convert-speed", "isoquant-variants", "report"}
    for name in subs:
        at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [name])
        entry = " ".join(" ".join(lines[at:at + 3]).split())  # the name, its description (wrapped when narrow)
        assert "-> docs/results/" in entry, name


@pytest.mark.parametrize("name", list(cli.build_parser()[1]))
def test_every_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: rq-eval {name}") and "writes docs/results/" in out


def test_rq_bench_is_rq_eval_bench(capsys):
    argv = ["--types", "f16,isoquant3_0-unfused", "--depths", "0,512", "-r", "3", "-t", "4"]
    ap, subs = cli.build_parser()
    assert {k: v for k, v in vars(ap.parse_args(["bench", *argv])).items() if k != "cmd"} == \
        vars(subs["bench"].parse_args(argv))
    assert cli.bench_main(["--types", "q9_9"]) == 1
    assert capsys.readouterr().err.startswith("rq-bench: error: unknown ggml type 'q9_9'")
    with pytest.raises(SystemExit):
        cli.bench_main(["--help"])
    assert capsys.readouterr().out.startswith("usage: rq-bench ")


def test_entry_points_resolve():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rq-eval"] == "rotaryquant.eval.cli:main"
    assert scripts["rq-bench"] == "rotaryquant.eval.cli:bench_main"
    for target in scripts.values():
        mod, fn = target.split(":")
        assert callable(getattr(import_module(mod), fn)), target


def test_default_outputs_are_the_results_files():
    _, subs = cli.build_parser()
    for name, stem in {"bench": "kv-bench", "ppl": "kv-quality", "convert-speed": "convert-bench",
                       "isoquant-variants": "isoquant-variants", "soak": "soak"}.items():
        assert subs[name].parse_args([]).out == cli.RESULTS / stem
