"""rq-convert building blocks: roles, types and fallbacks, recipes, kurtosis, the planner, quantisation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rotaryquant import bindings
from rotaryquant.converter import qtypes
from rotaryquant.converter import roles as R
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.qtypes import QT
from rotaryquant.converter.hf_folders import heavy_tailed
from rotaryquant.converter.recipes import RECIPES, Planner, get_recipe, parse_override
from rotaryquant.converter.stats import activation_kurtosis, excess_kurtosis
from rotaryquant.quants import itq3


@pytest.mark.parametrize("name,n_dims,role", [
    ("token_embd.weight", 2, R.TOKEN_EMBD),
    ("output.weight", 2, R.OUTPUT),
    ("output_norm.weight", 1, R.NORM),
    ("blk.3.attn_norm.weight", 1, R.NORM),
    ("blk.3.attn_q_norm.weight", 1, R.NORM),
    ("blk.0.attn_q.bias", 1, R.VECTOR),
    ("blk.0.attn_q.weight", 2, R.ATTENTION),
    ("blk.0.attn_qkv.weight", 2, R.ATTENTION),
    ("blk.0.attn_kv_a_mqa.weight", 2, R.ATTENTION),
    ("blk.12.ffn_down.weight", 2, R.FFN_DENSE),
    ("blk.12.ffn_gate_exps.weight", 3, R.FFN_ROUTED),
    ("blk.12.ffn_gate_up_exps.weight", 3, R.FFN_ROUTED),
    ("blk.12.ffn_down_shexp.weight", 2, R.FFN_SHARED),
    ("blk.12.ffn_gate_inp.weight", 2, R.ROUTER),
    ("blk.12.ffn_gate_inp_shexp.weight", 2, R.ROUTER),
    ("blk.1.ssm_in.weight", 2, R.OTHER),
])
def test_roles_from_names(name, n_dims, role):
    assert R.classify(name, n_dims) == role


def test_type_names_and_parsing():
    assert qtypes.type_name(QT.Q4_K) == "q4_K" and qtypes.type_name(QT.ITQ3_S) == "itq3_s"
    for spelling in ("q4_k", "Q4_K", "q4_K"):
        assert qtypes.parse_type(spelling) == QT.Q4_K
    assert qtypes.parse_type("itq3_s") == QT.ITQ3_S
    with pytest.raises(ConvertError, match="unknown type 'q9_9'"):
        qtypes.parse_type("q9_9")
    with pytest.raises(ConvertError, match="cannot be used"):
        qtypes.parse_type("isoquant3_0")
    # our names are ggml's own names
    for t in (QT.Q4_K, QT.Q2_K, QT.Q8_0, QT.ITQ3_S, QT.IQ4_NL, QT.F16, QT.Q6_K):
        assert bindings.type_name(int(t)) == qtypes.type_name(t)


@pytest.mark.parametrize("t,cols,want", [
    (QT.Q4_K, 1536, QT.Q4_K), (QT.Q4_K, 576, QT.Q5_0), (QT.Q2_K, 576, QT.Q4_0), (QT.ITQ3_S, 576, QT.IQ4_NL),
    (QT.Q6_K, 576, QT.Q8_0), (QT.Q5_K, 640, QT.Q5_1), (QT.Q4_K, 100, QT.F16), (QT.Q8_0, 100, QT.F16),
    (QT.F16, 7, QT.F16),
])
def test_fallback_is_llama_quantize_table(t, cols, want):
    got, why = qtypes.fit_type(t, cols)
    assert got == want
    assert (why is None) == (t == want)


def test_recipe_tables_exact():
    rq = RECIPES["rotaryquant"].table()
    assert (rq[R.ATTENTION], rq[R.FFN_DENSE], rq[R.FFN_ROUTED], rq[R.FFN_SHARED]) == ("q4_K", "q4_K", "q2_K", "q8_0")
    it = RECIPES["itq3"].table()
    assert {it[r] for r in (R.ATTENTION, R.FFN_DENSE, R.FFN_ROUTED, R.FFN_SHARED)} == {"itq3_s"}
    ri = RECIPES["rotaryquant-itq3"].table()
    assert (ri[R.ATTENTION], ri[R.FFN_DENSE], ri[R.FFN_ROUTED], ri[R.FFN_SHARED]) == ("itq3_s", "itq3_s", "q2_K", "q8_0")
    for r in ("rotaryquant", "itq3", "rotaryquant-itq3"):
        t = RECIPES[r].table()
        assert t[R.TOKEN_EMBD].startswith("q4_K") and t[R.OUTPUT].startswith("q6_K")
        assert t[R.NORM] == t[R.ROUTER] == "f32"
    with pytest.raises(ConvertError, match="unknown recipe"):
        get_recipe("q4_k_m")


def test_excess_kurtosis_matches_scipy():
    st = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for x in (rng.standard_normal(100_000), rng.laplace(size=50_000), heavy_tailed(rng, (300, 200), 1.0)):
        x = x.astype(np.float32)
        assert excess_kurtosis(x) == pytest.approx(st.kurtosis(x.astype(np.float64).ravel(), fisher=True, bias=True),
                                                   rel=1e-5, abs=1e-6)
    # the mixture the MoE toy uses is the paper's shared-expert shape (kappa ~ 10)
    assert 8.5 < excess_kurtosis(heavy_tailed(rng, (2000, 500), 0.02)) < 11.0
    assert math.isnan(excess_kurtosis(np.zeros(100)))


def test_activation_kurtosis():
    assert activation_kurtosis(np.ones(64)) == pytest.approx(0.0)
    s = np.ones(64)
    s[0] = 1000.0
    # 3 mean(s^2)/mean(s)^2 - 3 for one outlier channel
    want = 3 * np.mean(s * s) / np.mean(s) ** 2 - 3
    assert activation_kurtosis(s) == pytest.approx(want)
    assert activation_kurtosis(np.stack([s, np.ones(64)])) == pytest.approx(want / 2)


def test_planner_promotion_override_fallback():
    rng = np.random.default_rng(1)
    heavy = heavy_tailed(rng, (256, 512), 0.02)
    gauss = (rng.standard_normal((256, 512)) * 0.02).astype(np.float32)
    pl = Planner(get_recipe("rotaryquant"), overrides=[parse_override("attn_v=q8_0")], threshold=5.0)
    d = pl.decide("blk.0.attn_q.weight", heavy)
    assert d.promoted and d.qtype == QT.Q6_K and "kurtosis" in d.why
    d = pl.decide("blk.0.attn_k.weight", gauss)
    assert not d.promoted and d.qtype == QT.Q4_K
    d = pl.decide("blk.0.attn_v.weight", heavy)   # override wins over promotion
    assert d.overridden and d.qtype == QT.Q8_0 and "--tensor-type attn_v=q8_0" in d.why
    d = pl.decide("blk.0.ffn_up.weight", gauss[:, :500])  # 500 columns fit no 256- or 32-block
    assert d.fallback and d.qtype == QT.F16
    d = pl.decide("blk.0.ffn_gate_exps.weight", heavy.reshape(2, 128, 512))
    assert d.role == R.FFN_ROUTED and d.qtype == QT.Q4_K and d.promoted     # q2_K -> q4_K
    d = pl.decide("blk.0.attn_norm.weight", np.ones(512, np.float32))
    assert d.qtype == QT.F32 and d.kurtosis is None
    assert pl.weights_per_type()[QT.Q4_K] > 0
    # --no-promote: measured, not acted on
    pl2 = Planner(get_recipe("rotaryquant"), promote=False, measure=True)
    d = pl2.decide("blk.0.attn_q.weight", heavy)
    assert not d.promoted and d.kurtosis > 5
    # float recipes never promote
    d = Planner(get_recipe("f16")).decide("blk.0.attn_q.weight", heavy)
    assert d.qtype == QT.F16 and not d.promoted


def test_embeddings_and_output_follow_llama_cpp():
    x = np.zeros((1024, 512), np.float32)
    x[0, 0] = 1
    pl = Planner(get_recipe("rotaryquant"), tied=False)
    assert pl.decide("token_embd.weight", x).qtype == QT.Q4_K
    assert pl.decide("output.weight", x).qtype == QT.Q6_K
    assert pl.decide("output.weight", np.ones((8, 448), np.float32)).qtype == QT.Q8_0  # 448 % 256 != 0
    tied = Planner(get_recipe("itq3"), tied=True)
    assert tied.decide("token_embd.weight", x).qtype == QT.Q6_K
    assert tied.decide("token_embd.weight", np.ones((10, 576), np.float32)).qtype == QT.Q8_0


def test_itq3_m_mixture_rules():
    # IQ3_S's size spent as llama-quantize's _M types do: attn_k/attn_v Q6_K everywhere, dense ffn_down Q4_K outside
    # the middle quarter of the layers (28 layers: 10-16 keep ITQ3_S), untied embeddings ITQ3_S, no promotion
    heavy = np.random.default_rng(0).standard_t(3, (256, 512)).astype(np.float32)   # kurtosis far above 5
    pl = Planner(get_recipe("itq3-m"), tied=False, n_layers=28)
    got = {i: pl.decide(f"blk.{i}.ffn_down.weight", heavy).qtype for i in range(28)}
    assert [i for i, t in got.items() if t == QT.ITQ3_S] == list(range(10, 17))
    assert {t for i, t in got.items() if not 10 <= i < 17} == {QT.Q4_K}
    for name, want in (("blk.3.attn_k.weight", QT.Q6_K), ("blk.12.attn_v.weight", QT.Q6_K),
                       ("blk.3.attn_q.weight", QT.ITQ3_S), ("blk.3.attn_output.weight", QT.ITQ3_S),
                       ("blk.0.ffn_gate.weight", QT.ITQ3_S), ("token_embd.weight", QT.ITQ3_S),
                       ("output.weight", QT.Q6_K), ("blk.0.ffn_down_exps.weight", QT.ITQ3_S)):
        d = pl.decide(name, heavy)
        assert d.qtype == want and not d.promoted, (name, d.qtype, d.why)
    assert "itq3-m rule attn_[kv]" in pl.decide("blk.1.attn_k.weight", heavy).why
    # a tied embedding is the output matrix: llama.cpp's output rule, not the lookup's ITQ3_S
    assert Planner(get_recipe("itq3-m"), tied=True).decide("token_embd.weight", heavy).qtype == QT.Q6_K
    # the quarter scales with depth; an override still wins over a rule
    pl = Planner(get_recipe("itq3-m"), tied=False, n_layers=8, overrides=[parse_override("blk\\.0\\.ffn_down=q8_0")])
    assert [i for i in range(8) if pl.decide(f"blk.{i}.ffn_down.weight", heavy).qtype == QT.ITQ3_S] == [3, 4]
    assert pl.decisions[0].qtype == QT.Q8_0 and pl.decisions[0].overridden
    assert R.n_layers(["token_embd.weight", "blk.0.attn_k.weight", "blk.27.ffn_up.weight"]) == 28
    assert R.n_layers(["token_embd.weight"]) is None


def test_override_parsing():
    o = parse_override("BLK\\.0\\..*=Q8_0")
    assert o.pattern == "blk\\.0\\..*" and o.qtype == QT.Q8_0   # lower-cased like llama-quantize
    for bad, msg in (("attn_v", "REGEX=TYPE"), ("=q8_0", "empty pattern"), ("attn_[=q8_0", "bad regular"),
                     ("attn_v=q9", "unknown type")):
        with pytest.raises(ConvertError, match=msg):
            parse_override(bad)


def test_quantize_matches_ggml_and_numpy_itq3():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 512)) * 0.05).astype(np.float32)
    assert np.array_equal(qtypes.quantize(w, QT.ITQ3_S, threads=1), itq3.quantize_rows(w))
    assert np.array_equal(qtypes.quantize(w, QT.ITQ3_S, threads=1), bindings.quantize(w, int(QT.ITQ3_S)))
    for t in (QT.Q4_K, QT.Q2_K, QT.Q8_0, QT.IQ4_NL):
        assert np.array_equal(qtypes.quantize(w, t, threads=2), bindings.quantize(w, int(t)))
    assert qtypes.quantize(w, QT.F16).dtype == np.float16
    bf = qtypes.quantize(w, QT.BF16)
    assert bf.dtype == np.uint8 and bf.shape == (64, 1024)
    from gguf import quants

    assert np.array_equal(bf, np.asarray(quants.quantize(w, QT.BF16)).view(np.uint8).reshape(64, 1024))


def test_quantize_experts_with_imatrix_per_expert():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 8, 256)).astype(np.float32)
    im = rng.random((3, 256)).astype(np.float32) + 0.1
    for t in (QT.Q4_K, QT.ITQ3_S):
        got = qtypes.quantize(w, t, im, threads=2)
        assert got.shape == (3, 8, qtypes.row_bytes(t, 256))
        for e in range(3):
            want = itq3.quantize_rows(w[e], im[e]) if t == QT.ITQ3_S else bindings.quantize(w[e], int(t), im[e])
            assert np.array_equal(got[e], want)


def test_file_type_is_the_dominant_layer_type():
    from gguf import LlamaFileType

    assert qtypes.file_type_for({QT.Q4_K: 10, QT.Q6_K: 3}) == LlamaFileType.MOSTLY_Q4_K_M
    assert qtypes.file_type_for({QT.ITQ3_S: 10, QT.IQ4_NL: 3}) == LlamaFileType.MOSTLY_ITQ3_S
    assert qtypes.file_type_for({QT.F16: 1}) == LlamaFileType.MOSTLY_F16
