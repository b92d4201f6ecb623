"""rotaryquant.eval.report: renders every section and claim from small real results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rotaryquant.eval import gate, kvbench, kvquality, report


@pytest.mark.slow
def test_report_from_real_small_runs(tmp_path, gemma3, smollm2):
    from rotaryquant import data

    kvb = kvbench.bench(gemma3, configs=[c for c in kvbench.DEFAULT_CONFIGS if c[0] in ("f16", "isoquant3_0",
                                                                                        "isoquant3_0-unfused")],
                        depths=[0, 128], n_prompt=16, n_gen=4, reps=1, progress=lambda *_: None)
    (tmp_path / "kv-bench.json").write_text(json.dumps(kvb))
    kvq = kvquality.run(smollm2, data.evaluation_text(), kv_types=["f16", "q8_0"], ctxs=[128, 256], chunks=2,
                        progress=lambda *_: None)
    (tmp_path / "kv-quality.json").write_text(json.dumps(kvq))
    g = gate.run(smollm2, cache_type="f16", max_tokens=16, progress=lambda *_: None)
    (tmp_path / "gate.json").write_text(json.dumps([g]))

    out = report.build(tmp_path)
    md = out.read_text()
    for png in ("kv-tg-vs-depth.png", "kv-fused-vs-unfused.png", "kv-quality-kld-vs-ctx.png"):
        assert (tmp_path / png).stat().st_size > 5000
        assert f"]({png})" in md
    ledger = [ln for ln in md.splitlines() if any(ln.startswith(f"| {src} |") for src, *_ in report.CLAIMS)]
    assert len(ledger) == len(report.CLAIMS)
    assert "| isoquant3_0-unfused | 128 |" in md
    assert "| 256 | q8_0 |" in md
    assert "_not run: `rq-eval niah`_" in md  # sections without results say so


def test_ledger_lists_a_row_held_by_two_result_files_once(tmp_path):
    rows = [{"label": "f16", "ctx": 512, "ppl": 10.0, "kld_mean": None},
            {"label": "isoquant3_0", "ctx": 512, "ppl": 12.5, "kld_mean": 0.25}]
    src = Path(__file__).resolve().parents[2] / "docs/results/kv-quality.json"
    doc = json.loads(src.read_text())
    doc["rows"] = [{**doc["rows"][0], **r} for r in rows]
    doc["model"] = "m.gguf"
    for name in ("kv-quality-a.json", "kv-quality-b.json"):
        (tmp_path / name).write_text(json.dumps(doc))
    text = report.build(tmp_path).read_text()
    ledger = next(line for line in text.splitlines() if line.startswith("| RotaryQuant Tab. 3 |"))
    assert ledger.count("m.gguf ctx 512: ΔPPL +2.500") == 1, ledger


def test_itq_speed_ledger_uses_the_per_round_ratio_against_the_baseline():
    from rotaryquant.eval import report

    def row(name, med, ratio):
        return {"file": {"name": name}, "tg": {"median": med, "ratio": {"median": ratio}}}

    sp = {"settings": {"threads": 1, "rounds": 5},
          "rows": [row("m.IQ3_S.gguf", 3.0, 1.0), row("m.ITQ3_S.gguf", 7.0, 2.5), row("m.Q3_K_S.gguf", 7.0, 2.0),
                   row("m.ITQ3_S-oldkernel.gguf", 1.0, 0.3)]}
    text = report._itq_speed(sp)
    # against the baseline (first file): the median of per-round ratios, not 7/3; otherwise the ratio of medians
    assert "2.50× IQ3_S" in text and "1.00× Q3_K_S" in text and "threads 1" in text
    assert report._itq_speed({"rows": [row("m.Q3_K_S.gguf", 1.0, 1.0)]}) is None
