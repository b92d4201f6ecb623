"""weightspeed: the files run interleaved (A, B, A, B, ...), one repetition each; medians, spreads and
per-round ratios to the first file; a missing file or a failed run stops it with nothing written. A fake
llama-bench (a script logging its -m) stands in for the real one: no timing here."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from rotaryquant.eval import cli, weightspeed as ws

# t/s the fake reports: per file name, per call (round); pp then tg
FAKE = """#!{py}
import json, os, sys
a = sys.argv[1:]
m = os.path.basename(a[a.index("-m") + 1])
log = os.environ["FAKE_LOG"]
with open(log, "a") as f:
    f.write("llama-bench " + " ".join(a) + "\\n")
k = sum(1 for line in open(log) if os.path.basename(line.split(" -m ")[1].split()[0]) == m) - 1
if m in os.environ.get("FAKE_FAIL", "").split(","):
    sys.stderr.write("model load failed"); sys.exit(2)
t = json.loads(os.environ["FAKE_TS"])[m][k]
print(json.dumps([{{"n_prompt": int(a[a.index("-p") + 1]), "n_gen": 0, "avg_ts": t[0]}},
                  {{"n_prompt": 0, "n_gen": int(a[a.index("-n") + 1]), "avg_ts": t[1]}}]))
"""


def _gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a", np.zeros((4, 256), np.float32))
    w.add_tensor("b", np.zeros((2, 256), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE.format(py=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setattr(ws.tools, "binary", lambda name: exe)
    files = [_gguf(tmp_path / f"{n}.gguf") for n in ("a", "b", "c")]
    return exe, log, files


def _calls(log: Path) -> list[str]:
    return [line.split(" -m ")[1].split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def test_file_info(tmp_path):
    info = ws.file_info(_gguf(tmp_path / "x.gguf"))
    assert info.n_params == 6 * 256
    assert info.types == {"F32": 1024, "F16": 512}
    assert info.bpw == pytest.approx(8 * (1024 * 4 + 512 * 2) / 1536)


def test_summary_median_quartiles_spread():
    s = ws.summary([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert ws.summary([2.0, 4.0])["median"] == 3.0
    assert ws.summary([7.0])["q1"] == 7.0


def test_interleaved_order_and_arguments(fake, monkeypatch):
    exe, log, files = fake
    ts = {f.name: [[10.0, 1.0]] * 3 for f in files}
    monkeypatch.setenv("FAKE_TS", json.dumps(ts))
    res = ws.measure(files, rounds=3, n_prompt=64, n_gen=16, threads=3, progress=lambda s: None)
    assert _calls(log) == [str(f) for f in files] * 3
    first = log.read_text().splitlines()[0].split()
    for flag, v in (("-p", "64"), ("-n", "16"), ("-t", "3"), ("-r", "1"), ("-o", "json")):
        assert first[first.index(flag) + 1] == v
    assert res["order"] == [[f.name for f in files]] * 3


def test_ratios_are_per_round_then_median(fake, monkeypatch):
    _, _, files = fake
    # round 2 is a slow round for everyone: per-round ratios hide it, ratios of medians would not
    ts = {"a.gguf": [[100.0, 10.0], [50.0, 5.0], [100.0, 10.0]],
          "b.gguf": [[200.0, 12.0], [100.0, 6.0], [220.0, 13.0]],
          "c.gguf": [[90.0, 15.0], [40.0, 11.0], [100.0, 21.0]]}
    monkeypatch.setenv("FAKE_TS", json.dumps(ts))
    res = ws.measure(files, rounds=3, progress=lambda s: None)
    a, b, c = res["rows"]
    assert a["tg"]["ratio"]["median"] == 1.0 and a["pp"]["ratios"] == [1.0, 1.0, 1.0]
    assert b["pp"]["ts"] == [200.0, 100.0, 220.0] and b["pp"]["median"] == 200.0
    assert (b["pp"]["min"], b["pp"]["max"]) == (100.0, 220.0)
    assert b["pp"]["ratios"] == [2.0, 2.0, 2.2] and b["pp"]["ratio"]["median"] == 2.0
    assert b["tg"]["ratios"] == pytest.approx([1.2, 1.2, 1.3]) and b["tg"]["ratio"]["median"] == pytest.approx(1.2)
    assert c["tg"]["ratios"] == pytest.approx([1.5, 2.2, 2.1]) and c["tg"]["ratio"]["median"] == pytest.approx(2.1)
    assert c["tg"]["median"] / a["tg"]["median"] == pytest.approx(1.5)  # not the ratio of the medians
    md = ws.to_markdown(res)
    assert "| b.gguf | 0 | 26.667 | 200.00 [100.00-220.00] | 2.000 [2.000-2.200] | 12.00 [6.00-13.00] |" in md
    assert "ratios to **a.gguf**" in md and "- a.gguf: F32 67%, F16 33%" in md


def test_cli_writes_json_and_markdown(fake, monkeypatch, tmp_path):
    _, log, files = fake
    monkeypatch.setenv("FAKE_TS", json.dumps({f.name: [[10.0 + i, 2.0 + i]] * 5 for i, f in enumerate(files)}))
    out = tmp_path / "res" / "weight-speed-x"
    assert cli.main(["weight-speed", *map(str, files[:2]), "-o", str(out)]) == 0
    assert _calls(log) == [str(files[0]), str(files[1])] * 5  # 5 rounds by default
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["settings"]["rounds"] == 5 and data["settings"]["n_prompt"] == 512 and data["settings"]["n_gen"] == 128
    assert data["rows"][1]["tg"]["ratio"]["median"] == pytest.approx(1.5)
    assert data["command"].startswith("rq-eval weight-speed ")
    assert "| b.gguf |" in out.with_suffix(".md").read_text()


def test_missing_file_runs_nothing_writes_nothing(fake, monkeypatch, tmp_path, capsys):
    _, log, files = fake
    out = tmp_path / "res" / "ws"
    assert cli.main(["weight-speed", str(files[0]), str(tmp_path / "nope.gguf"), "-o", str(out)]) == 1
    assert f"no such file: {tmp_path / 'nope.gguf'}" in capsys.readouterr().err
    assert _calls(log) == [] and not out.parent.exists()


def test_failed_run_names_the_file_writes_nothing(fake, monkeypatch, tmp_path, capsys):
    _, log, files = fake
    monkeypatch.setenv("FAKE_TS", json.dumps({f.name: [[1.0, 1.0]] * 5 for f in files}))
    monkeypatch.setenv("FAKE_FAIL", "b.gguf")
    out = tmp_path / "res" / "ws"
    assert cli.main(["weight-speed", *map(str, files), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "llama-bench failed on b.gguf (exit 2): model load failed" in err
    assert _calls(log) == [str(files[0]), str(files[1])] and not out.parent.exists()


def test_bad_arguments():
    with pytest.raises(ws.WeightSpeedError, match="no GGUF file"):
        ws.measure([])
    with pytest.raises(ws.WeightSpeedError, match="rounds must be at least 1"):
        ws.measure([Path(os.devnull)], rounds=0)


def test_a_file_name_with_a_comma_reaches_llama_bench_whole(tmp_path):
    # llama-bench splits -m on commas; a mixture's file name holds its --custom-q ("blk\.[0-5]...,blk\.2[2-7]...")
    from rotaryquant.eval import weightspeed as ws

    model = tmp_path / "ik-IQ3_K_--custom-q_a-q4_K,b-q4_K.gguf"
    model.write_bytes(b"GGUF")
    bench = tmp_path / "llama-bench"
    bench.write_text('#!/bin/sh\ncase "$2" in *,*) echo "split: $2" >&2; exit 1 ;; esac\n'
                     '[ "$(cat "$2")" = GGUF ] || exit 2\n'
                     'echo \'[{"n_gen": 0, "avg_ts": 50.0}, {"n_gen": 16, "avg_ts": 10.0}]\'\n')
    bench.chmod(0o755)
    got = ws.run_llama_bench(bench, model, n_prompt=32, n_gen=16, threads=1, timeout=60)
    assert got == {"pp": 50.0, "tg": 10.0}
