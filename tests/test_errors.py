"""One CLI error model (rotaryquant.errors): RQError(message, fix), and run_cli's exit codes 1 (error, one
line), 2 (usage), 130 (Ctrl-C); a missing build names the command that builds it, a missing input file is
not mistaken for one."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from rotaryquant.errors import MissingBuildError, RQError, UsageError, run_cli

REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(prog="rq-x")
    ap.add_argument("--n", type=int, required=True)
    ap.parse_args(argv)


def _raise(e: BaseException):
    def main(argv: list[str] | None) -> None:
        raise e
    return main


def test_message_and_fix_make_one_line():
    e = RQError("model m.gguf does not exist", "give the path of a .gguf file")
    assert str(e) == "model m.gguf does not exist; give the path of a .gguf file"
    assert (e.message, e.fix) == ("model m.gguf does not exist", "give the path of a .gguf file")
    assert str(RQError("plain")) == "plain" and RQError("plain").fix is None
    assert "make setup" in str(MissingBuildError("llama-bench is not built"))


def test_exit_codes(capsys):
    assert run_cli("rq-x", lambda argv: None) == 0
    assert run_cli("rq-x", lambda argv: 3) == 3
    assert run_cli("rq-x", _raise(RQError("bad input", "fix it"))) == 1
    assert capsys.readouterr().err == "rq-x: error: bad input; fix it\n"
    assert run_cli("rq-x", _raise(UsageError("--a and --b exclude each other"))) == 2
    assert capsys.readouterr().err == "rq-x: error: --a and --b exclude each other\n"
    assert run_cli("rq-x", _raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "rq-x: interrupted\n"
    assert run_cli("rq-x", _raise(KeyboardInterrupt()), interrupted="interrupted; nothing written") == 130
    assert capsys.readouterr().err == "rq-x: interrupted; nothing written\n"


def test_argparse_usage_is_2_and_help_0(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own exit passes through: a script exits 2
        run_cli("rq-x", _parse, ["--n", "many"])
    assert e.value.code == 2
    assert "rq-x: error: argument --n: invalid int value" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_cli("rq-x", _parse, ["--help"])
    assert e.value.code == 0


def test_no_catch_all(capsys):
    with pytest.raises(ZeroDivisionError):
        run_cli("rq-x", _raise(ZeroDivisionError()))
    with pytest.raises(ValueError):
        run_cli("rq-x", _raise(ValueError("a bug, not a user error")))
    assert capsys.readouterr().err == ""


def test_missing_input_file_is_not_a_missing_build(tmp_path, capsys):
    def main(argv: list[str] | None) -> None:
        (tmp_path / "input.txt").read_text()

    with pytest.raises(FileNotFoundError):  # a bug of the command that let it through: not "run make setup"
        run_cli("rq-x", main)
    assert "make setup" not in capsys.readouterr().err


def test_missing_program_names_make_setup(tmp_path, monkeypatch, capsys):
    from rotaryquant.bindings import tools

    monkeypatch.setenv("RQ_BIN_DIR", str(tmp_path))
    assert run_cli("rq-x", lambda argv: print(tools.binary("llama-bench"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("rq-x: error: llama-bench is not built") and "make setup" in err
    assert err.count("\n") == 1


def test_missing_library_names_make_setup(tmp_path, monkeypatch, capsys):
    from rotaryquant.bindings import ggml

    monkeypatch.setattr(ggml, "lib_dir", lambda: tmp_path)
    ggml._ggml.cache_clear()
    try:
        assert run_cli("rq-x", lambda argv: print(ggml.rq_version())) == 1
    finally:
        ggml._ggml.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("rq-x: error: the patched ggml libraries cannot be loaded") and "make setup" in err


def test_missing_llama_cpp_names_make_setup(monkeypatch):
    from rotaryquant.bindings import ggml

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    with pytest.raises(MissingBuildError, match="make setup"):
        ggml.load_llama_cpp()


def test_a_missing_build_in_a_real_process(tmp_path):
    code = ("import sys; from rotaryquant.errors import run_cli; from rotaryquant.bindings import tools; "
            "sys.exit(run_cli('rq-x', lambda argv: tools.binary('llama-server')))")
    env = {**os.environ, "RQ_BIN_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("rq-x: error: llama-server is not built") and "make setup" in p.stderr
    assert "Traceback" not in p.stderr


def test_rq_eval_missing_model_is_not_a_missing_build(capsys):
    from rotaryquant.eval import cli

    assert cli.main(["niah", "--model", "/nonexistent.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rq-eval: error: model /nonexistent.gguf does not exist")
    assert "make setup" not in err and "not built" not in err


def test_rq_calibrate_missing_model_is_not_a_missing_build(tmp_path, capsys):
    from rotaryquant.converter.calibrate_cli import main

    assert main([str(tmp_path / "missing.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rq-calibrate: error: model ") and "does not exist" in err and "make setup" not in err


def test_every_project_error_is_an_rqerror():
    from rotaryquant import assets
    from rotaryquant.bindings import RQTypeError
    from rotaryquant.build.common import SetupError
    from rotaryquant.converter.errors import ConvertError
    from rotaryquant import plan_verify
    from rotaryquant.eval import convertspeed, decode, kvbench, niah, perplexity, serve, weights, weightspeed

    for cls in (ConvertError, assets.AssetError, SetupError, RQTypeError, convertspeed.ConvertSpeedError,
                decode.DecodeError, kvbench.BenchError, niah.NiahError, perplexity.PerplexityError,
                plan_verify.VerifyError, serve.ServeError, weights.WeightsBenchError, weightspeed.WeightSpeedError):
        assert issubclass(cls, RQError), cls
    assert issubclass(RQTypeError, ValueError)  # callers that parse type names catch ValueError


SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_goes_through_run_cli(name, monkeypatch, capsys):
    mod, fn = SCRIPTS[name].split(":")
    main = getattr(import_module(mod), fn)
    for exc, rc, line in ((KeyboardInterrupt(), 130, f"{name}: interrupted"),
                          (RQError("boom", "fix"), 1, f"{name}: error: boom; fix\n")):
        def parse(self, *a, exc=exc, **k):
            raise exc
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
        assert main([]) == rc
        assert capsys.readouterr().err.startswith(line)
