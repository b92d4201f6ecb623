"""rq-convert's --help documents every recipe's types; the benchmark's smoke run writes its tables."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rotaryquant.converter.cli import build_parser
from rotaryquant.converter.recipes import RECIPES


def test_help_lists_every_recipe_with_its_types():
    text = build_parser().format_help()
    for name, r in RECIPES.items():
        assert f"  {name} " in text
        t = r.table()
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("attention=") and
                    f"attention={t['attention']}," in ln and f"ffn_routed={t['ffn_routed']}," in ln)
        assert f"ffn_shared={t['ffn_shared']}" in line
    assert "--tensor-type" in text and "--kurtosis-threshold" in text and "--dry-run" in text
    assert "10.10" in text  # the paper's reference kappa


def test_no_output_is_a_usage_error(capsys):
    from rotaryquant.converter.cli import main

    assert main(["somewhere"]) == 2
    assert "no output file" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_tiny_writes_json_and_markdown(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rotaryquant.converter.bench", "--tiny", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "convert-bench.json").read_text())
    paths = {r["path"] for r in data["rows"]}
    assert paths == {"rq-convert", "upstream"}
    for r in data["rows"]:
        assert r["mw_per_s"] > 0 and r["peak_rss_mb"] > 10 and r["output_mb"] > 1
    md = (tmp_path / "convert-bench.md").read_text()
    assert "| smollm2-135m-2L | hf | rotaryquant | rq-convert |" in md
