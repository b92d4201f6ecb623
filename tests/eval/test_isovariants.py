"""isovariants: the statistics it builds on, the shape of a small run, and (slow) that the tables in
docs/isoquant-design.md are its output, unedited."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rotaryquant.eval import isovariants as iv

REPO = Path(__file__).resolve().parents[2]


def test_paired_change():
    b = np.array([1.0, 2.0, 3.0])
    assert iv.paired(b, b) == (0.0, 0.0)
    change, se2 = iv.paired(2 * b, b)
    assert change == pytest.approx(100.0) and se2 > 0


def test_calibrated_beta_hits_the_target():
    rng = np.random.default_rng(0)
    K, Q = rng.standard_normal((2, iv.T, iv.D)), rng.standard_normal((2, iv.NQ, iv.D))
    b = iv.calibrate_beta(K, Q, 0.5)
    p = iv.softmax(b * np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(iv.D))
    assert p.max(-1).mean() == pytest.approx(0.5, abs=1e-3)


def test_attention_of_an_exact_copy_is_lossless():
    rng = np.random.default_rng(1)
    K, V, Q = (rng.standard_normal((1, n, iv.D)) for n in (iv.T, iv.T, iv.NQ))
    kl, err = iv.attn(K, V, K, V, Q, 1.0)
    assert kl.shape == err.shape == (iv.NQ,)
    assert np.abs(kl).max() < 1e-12 and err.max() < 1e-12


def test_no_s_variant_is_the_signed_roundtrip():
    x = iv.datasets(256).sets["keys"]
    want = iv.roundtrip(x * iv.iq.SIGNS, "v1", "preserve") * iv.iq.SIGNS
    assert np.array_equal(iv.roundtrip(x, "v1-noS", "preserve"), want)
    assert not np.array_equal(iv.roundtrip(x, "v1", "preserve"), want)


def test_small_run():
    res = iv.run(n=512)
    meta = res["meta"]
    assert len(res["vectors"]) == len(meta["datasets"]) * len(iv.VARIANTS) * len(iv.DEFAULT_MODES)
    g = next(r for r in res["vectors"] if (r["data"], r["variant"], r["mode"]) == ("gauss", "v3", "raw"))
    assert g["rel_mse"] == pytest.approx(meta["lloyd_mse"], rel=0.15)  # Gaussian input: the Lloyd-Max design point
    assert len(res["attention"]) == len(iv.SETTINGS)
    for a in res["attention"]:
        assert a["contexts"] == 2 and len(a["rows"]) == len(iv.VARIANTS) * len(iv.DEFAULT_MODES)
        assert all(v >= 0 for r in a["rows"] for v in r["kl"].values())
        assert [(p["compared"], p["reference"]) for p in a["paired"]] == [
            ("v3/raw", "v3/preserve"), ("v3-noS/preserve", "v3/preserve"), ("v1/preserve", "v3/preserve")]
    md = iv.to_markdown(res)
    assert "mean over 0.512k vectors" in md and md.count("| v3-noS | raw |") == 1 + len(iv.SETTINGS)


def test_run_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown norm_mode 'median'"):
        iv.run(modes=("raw", "median"), n=512)
    with pytest.raises(ValueError, match="at least 256"):
        iv.run(n=255)


@pytest.mark.slow
def test_design_doc_tables_are_the_output():
    md = iv.to_markdown(iv.run())
    assert md.strip() in (REPO / "docs" / "isoquant-design.md").read_text()
