"""eval/weights.py without running a model: the variant set, merging earlier rows, the table."""

from __future__ import annotations

import pytest

from rotaryquant.eval import weights


def test_variants_cover_each_type_with_and_without_calibration():
    labels = [v.label for v in weights.DEFAULT_VARIANTS]
    assert len(labels) == len(set(labels))
    for t in ("Q4_K_M", "Q3_K_M", "Q3_K_S", "IQ3_S", "ITQ3_S"):
        assert t in labels and f"{t}+imat" in labels
    assert "IQ3_XXS+imat" in labels
    rq = {v.label: v for v in weights.DEFAULT_VARIANTS if v.recipe}
    # the calibrated rq-convert row has its uncalibrated control through the same recipe
    assert rq["ITQ3_S/rq+cal"].calibrate and not rq["ITQ3_S/rq"].calibrate
    assert rq["ITQ3_S/rq+cal"].recipe == rq["ITQ3_S/rq"].recipe
    # the default recipe is measured as users run it (kurtosis promotion on); the ITQ3_S rows keep
    # llama-quantize's tensor types
    assert rq["rotaryquant"].promote and not rq["ITQ3_S/rq+cal"].promote
    # tensor mode has no rq-convert rows (it is llama-quantize --tensor-type only)
    assert all(v.recipe is None for v in weights.tensor_variants())


def test_rq_convert_rows_pass_their_overrides_and_promotion(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(weights, "_run", lambda cmd, what, timeout=0: seen.append([str(c) for c in cmd]) or "")
    rq = {v.label: v for v in weights.DEFAULT_VARIANTS if v.recipe}
    for label in ("ITQ3_S-M/rq+cal", "rotaryquant"):
        weights.convert(tmp_path / "f16.gguf", rq[label], tmp_path / "out.gguf", tmp_path / "c.txt", 2)
    mix, default = seen
    assert [mix[i + 1] for i, a in enumerate(mix) if a == "--tensor-type"] == list(rq["ITQ3_S-M/rq+cal"].overrides)
    assert "--no-promote" in mix and "--calibrate" in mix
    assert "--no-promote" not in default and "--tensor-type" not in default


def test_merge_refuses_another_model_or_setting(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"")
    monkeypatch.setattr(weights, "requantize_f16", lambda s, d: d)
    with pytest.raises(weights.WeightsBenchError, match="cannot merge into a result for other.gguf ctx 512"):
        weights.bench(src, tmp_path, tmp_path / "e.txt", tmp_path / "c.txt", variants=(), chunks=10,
                      merge={"model": "other.gguf", "ctx": 512, "chunks": 10, "rows": []})
    with pytest.raises(weights.WeightsBenchError, match="chunks 20: this run is m.gguf ctx 512 chunks 10"):
        weights.bench(src, tmp_path, tmp_path / "e.txt", tmp_path / "c.txt", variants=(), chunks=10,
                      merge={"model": "m.gguf", "ctx": 512, "chunks": 20, "rows": []})


def _res(timed: bool) -> dict:
    rows = [{"label": "F16", "bytes": 2**21, "bpw": 16.0, "ppl": 10.0, "kld_mean": None, "kld_p99": None,
             "same_top_p": None, "types": {"F16": 90, "F32": 10}},
            {"label": "ITQ3_S+imat", "bytes": 2**20, "bpw": 3.5, "ppl": 11.5, "kld_mean": 0.1234, "kld_p99": 0.9,
             "same_top_p": 80.5, "types": {"ITQ3_S": 85, "Q6_K": 14, "F32": 1}}]
    if timed:
        for r in rows:
            r.update(pp_tps=100.0, tg_tps=20.0)
    return {"model": "m.gguf", "params": 1e6, "ctx": 512, "chunks": 10, "calib_tokens": 4096, "rows": rows}


def test_table_without_speed_shows_the_mixture():
    md = weights.to_markdown(_res(False), "t")
    assert "weights by type" in md and "tg t/s" not in md and "rq-eval weight-speed" in md
    row = next(line for line in md.splitlines() if line.startswith("| ITQ3_S+imat"))
    assert "| +1.500 | 0.1234 |" in row and "ITQ3_S 85%, Q6_K 14%, F32 1%" in row
    assert "first 4096 tokens" in md


def test_table_with_speed():
    md = weights.to_markdown(_res(True), "t")
    assert "| pp t/s | tg t/s |" in md and "| 100.0 | 20.0 |" in md


def test_rows_are_reported_as_they_are_measured_and_merged(tmp_path, monkeypatch):
    from rotaryquant.eval import perplexity

    src = tmp_path / "m.gguf"
    src.write_bytes(b"")
    calls = []

    def fake_ppl(model, text, *, label, kld_base, save_base=False, **kw):
        if save_base:
            kld_base.write_bytes(b"logits")
        return perplexity.PplResult(label, 10.0 + len(label), 0.1, kld_mean=None if save_base else 0.1)

    def fake_quantize(f16, v, dst, imat, threads, calib):
        dst.write_bytes(b"x" * 100)
        return dst

    monkeypatch.setattr(weights, "requantize_f16", lambda s, d: (d.write_bytes(b"f" * 400), d)[1])
    monkeypatch.setattr(weights, "_n_params", lambda f: 200)
    monkeypatch.setattr(weights.perplexity, "run", fake_ppl)
    monkeypatch.setattr(weights, "quantize", fake_quantize)
    monkeypatch.setattr(weights, "tensor_types", lambda q: {"Q4_K": 200})
    vs = tuple(v for v in weights.DEFAULT_VARIANTS if v.label in ("IQ3_S", "ITQ3_S"))
    res = weights.bench(src, tmp_path, tmp_path / "e.txt", tmp_path / "c.txt", variants=vs, chunks=10,
                        on_row=lambda r: calls.append([x["label"] for x in r["rows"]]))
    assert calls == [["F16"], ["F16", "IQ3_S"], ["F16", "IQ3_S", "ITQ3_S"]]
    assert [r["bpw"] for r in res["rows"]] == [16.0, 4.0, 4.0]
    # a later run keeps F16 and the rows it does not redo, and reuses the baseline logits
    again = weights.bench(src, tmp_path, tmp_path / "e.txt", tmp_path / "c.txt", variants=vs[1:], chunks=10,
                          merge=res)
    assert [r["label"] for r in again["rows"]] == ["F16", "IQ3_S", "ITQ3_S"]
