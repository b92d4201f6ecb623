"""rotaryquant.eval.kvbench: KV sizes from the model's shapes, and one tiny llama-bench run."""

from __future__ import annotations

import pytest

from rotaryquant.eval import kvbench


def test_kv_bytes_per_token(gemma3, smollm2):
    g = kvbench.kv_shape(gemma3)
    assert g.n_layer == 18 and set(g.n_embd_k_gqa) == {256}
    assert g.bytes_per_token("f16") == 18 * 2 * 256 * 2
    # exactly 50 bytes per 128 values: 50/256 of F16
    assert g.bytes_per_token("isoquant3_0") / g.bytes_per_token("f16") == 50 / 256
    s = kvbench.kv_shape(smollm2)
    assert s.n_layer == 30 and set(s.n_embd_k_gqa) == {192}
    # head size 64: isoquant3_0 runs as isoquant3_64, 26 bytes per 64 values
    assert s.head_k == s.head_v == 64
    assert s.bytes_per_token("isoquant3_0") == 30 * 2 * 192 * 26 / 64
    assert s.bytes_per_token("q8_0/isoquant4_0") == 30 * 192 * (34 / 32 + 34 / 64)


@pytest.mark.slow
def test_bench_runs_and_computes_ratios(gemma3):
    res = kvbench.bench(gemma3, configs=[c for c in kvbench.DEFAULT_CONFIGS if c[0] in ("f16", "isoquant3_0",
                                                                                      "isoquant3_0-unfused")],
                        depths=[0], n_prompt=16, n_gen=4, reps=1, progress=lambda *_: None)
    rows = {r["label"]: r for r in res["rows"]}
    assert set(rows) == {"f16", "isoquant3_0", "isoquant3_0-unfused"}
    assert all(r["tg_tps"] > 0 and r["pp_tps"] > 0 for r in rows.values())
    assert rows["f16"]["extra"]["tg_vs_f16"] == pytest.approx(1.0)
    assert "tg_fused_over_unfused" in rows["isoquant3_0"]["extra"]
    assert "| isoquant3_0 | 0 |" in kvbench.to_markdown(res)


def test_config_suffixes():
    assert kvbench.config("q4_0") == ("q4_0", "q4_0", False)
    assert kvbench.config("isoquant3_0-unfused") == ("isoquant3_0-unfused", "isoquant3_0", True)
    assert kvbench.config("isoquant3_0+calib-deferred") == ("isoquant3_0+calib-deferred", "isoquant3_0+calib", False)
    assert kvbench.config("isoquant3_0-unfused-deferred")[1:] == ("isoquant3_0", True)
    with pytest.raises(ValueError, match="unknown ggml type 'q5_9'"):
        kvbench.config("q5_9-deferred")


@pytest.mark.slow
def test_deferred_rows_get_ratios_over_their_plain_twin(gemma3):
    res = kvbench.bench(gemma3, configs=[kvbench.config(c) for c in ("f16", "q8_0", "q8_0-deferred")],
                        depths=[0], n_prompt=16, n_gen=4, reps=1, progress=lambda *_: None)
    rows = {r["label"]: r for r in res["rows"]}
    assert {"pp_deferred_over_plain", "tg_deferred_over_plain"} <= set(rows["q8_0-deferred"]["extra"])
    assert "Deferred prefill" in kvbench.to_markdown(res)
