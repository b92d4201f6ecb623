"""convertspeed: the plan checks its names, run_measured reports the child's own peak RSS and its
failures, the table renders each row; the smoke run (slow) writes both files."""

from __future__ import annotations

import json
import math
import resource
import sys

import pytest

from rotaryquant.eval import cli, convertspeed as cs

ALLOC = "b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096])"


def test_plan_rejects_unknown_names():
    with pytest.raises(cs.ConvertSpeedError, match="unknown model 'llama'"):
        cs.Plan(["smollm2", "llama"], ["rotaryquant"], ["hf"])
    with pytest.raises(cs.ConvertSpeedError, match="unknown input 'onnx'"):
        cs.Plan(["smollm2"], ["rotaryquant"], ["onnx"])
    with pytest.raises(cs.ConvertSpeedError, match="recipe 'f32'"):
        cs.Plan(["gemma3"], ["f32"], ["gguf"])
    with pytest.raises(cs.ConvertSpeedError, match="no recipe"):
        cs.Plan(["gemma3"], [], ["gguf"])


def test_tiny_plan():
    p = cs.Plan(["smollm2", "gemma3"], ["itq3", "q8_0"], ["hf", "gguf"]).tiny()
    assert (p.models, p.recipes, p.inputs, p.layers) == (["smollm2"], ["itq3"], ["hf"], 2)


@pytest.mark.parametrize("nice", [0, 5])
def test_run_measured_is_the_childs_peak(nice):
    # a child starts at its parent's RSS (the floor): allocate well above this process's peak
    mb = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024) + 64
    s = cs.run_measured([sys.executable, "-c", ALLOC.format(mb=mb)], nice=nice)
    assert s.rc == 0 and s.seconds > 0
    assert s.peak_rss_mb >= mb  # through `nice` too: it execs the command
    assert (s.cmd[:3] == ["nice", "-n", "5"]) == bool(nice)


def test_run_measured_failure_names_the_command():
    with pytest.raises(cs.ConvertSpeedError, match=r"failed \(3\): .*boom"):
        cs.run_measured([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])


def test_markdown_and_json():
    rows = [cs.Row("m", "hf", "itq3", "rq-convert", 3_000_000, 2.0, 300.4, 1.5),
            cs.Row("m", "hf", "itq3", "upstream", 3_000_000, 0.0, 500.0, 1.4)]
    meta = {"command": "rq-eval convert-speed", "machine": "x", "cpus": 2, "date": "d", "parent_rss_mb": 40.0}
    md = cs.to_markdown(rows, meta)
    assert "| m | hf | itq3 | rq-convert | 3.0 | 2.0 | 1.50 | 300 | 1.5 |" in md
    assert "| m | hf | itq3 | upstream | 3.0 | 0.0 | nan | 500 | 1.4 |" in md
    assert "held 40 MB" in md
    d = json.loads(json.dumps(cs.as_dict(rows, meta)))
    assert d["rows"][0]["mw_per_s"] == 1.5 and math.isnan(d["rows"][1]["mw_per_s"])
    assert cs.meta("x")["parent_rss_mb"] > 0


@pytest.mark.slow
def test_tiny_run_writes_json_and_markdown(tmp_path):
    assert cli.main(["convert-speed", "--tiny", "-o", str(tmp_path / "convert-bench")]) == 0
    data = json.loads((tmp_path / "convert-bench.json").read_text())
    assert data["meta"]["command"] == f"rq-eval convert-speed --tiny -o {tmp_path / 'convert-bench'}"
    paths = {r["path"] for r in data["rows"]}
    assert paths == {"rq-convert", "upstream"}
    for r in data["rows"]:
        assert r["mw_per_s"] > 0 and r["peak_rss_mb"] > 10 and r["output_mb"] > 1
    md = (tmp_path / "convert-bench.md").read_text()
    assert "| smollm2-135m-2L | hf | rotaryquant | rq-convert |" in md
