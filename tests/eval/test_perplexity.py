"""rotaryquant.eval.perplexity / kvquality on the real default models, small enough for CI."""

from __future__ import annotations

import pytest

from rotaryquant import data
from rotaryquant.eval import kvquality, perplexity

pytestmark = pytest.mark.slow


def test_text_slices_are_disjoint():
    calib = data.calibration_text().read_text()
    ev = data.evaluation_text().read_text()
    assert len(calib) > 500_000 and len(ev) > 500_000
    assert ev[:2000] not in calib


def test_f16_against_itself_is_zero_and_q8_beats_q4(smollm2):
    res = kvquality.run(smollm2, data.evaluation_text(), kv_types=["f16", "q8_0", "q4_0"], ctxs=[256], chunks=3,
                        progress=lambda *_: None)
    rows = {r["label"]: r for r in res["rows"]}
    assert rows["f16"]["kld_mean"] is None  # the baseline run only saves logits
    again = perplexity.run(smollm2, data.evaluation_text(), label="f16-again", ctx=256, chunks=3)
    assert abs(again.ppl - rows["f16"]["ppl"]) < 1e-3
    assert 0 < rows["q8_0"]["kld_mean"] < rows["q4_0"]["kld_mean"]
    assert rows["q8_0"]["same_top_p"] > rows["q4_0"]["same_top_p"]
    md = kvquality.to_markdown(res)
    assert "| 256 | q4_0 |" in md


def test_kld_of_identical_run_is_zero(smollm2, tmp_path):
    base = tmp_path / "base.kld"
    perplexity.run(smollm2, data.evaluation_text(), label="base", ctx=256, chunks=2, kld_base=base, save_base=True)
    same = perplexity.run(smollm2, data.evaluation_text(), label="same", ctx=256, chunks=2, kld_base=base)
    assert same.kld_mean is not None and abs(same.kld_mean) < 1e-6
    assert same.same_top_p == pytest.approx(100.0)


def test_errors_name_the_problem(smollm2, tmp_path):
    with pytest.raises(perplexity.PerplexityError, match="failed"):
        perplexity.run(tmp_path / "missing.gguf", data.evaluation_text(), label="missing", ctx=256, chunks=1)


def test_ik_llama_final_estimate_is_read():
    # ik_llama.cpp names the chunks and context in its plain-run summary line
    r = perplexity.parse_output("ik", "Final estimate: PPL over 2 chunks for n_ctx=2048 = 31.8672 +/- 1.20345\n")
    assert (r.ppl, r.ppl_err) == (31.8672, 1.20345)
