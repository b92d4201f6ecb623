"""Per-layer KV bit allocation (converter/kvalloc.py, rq-calibrate --kv-bits, --kv-layer-types model)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from rotaryquant.converter import kvalloc
from rotaryquant.converter.errors import ConvertError

PROMPT = "The three most important inventions of the nineteenth century were"


def test_choose_lowers_the_least_kld_per_bit_until_the_budget_is_met():
    sens = [0.5, 0.1, -0.2, 0.3, 0.1]
    saved = [0.1, 0.1, 0.1, 0.1, 0.2]
    # per bit: 5.0, 1.0, 0 (negative counts as 0), 3.0, 0.5 -> order 2, 4, 1, 3, 0
    assert kvalloc.choose(sens, saved, 4.0, 4.0) == []
    assert kvalloc.choose(sens, saved, 4.0, 3.9) == [2]
    assert kvalloc.choose(sens, saved, 4.0, 3.75) == [2, 4]
    assert kvalloc.choose(sens, saved, 4.0, 3.65) == [1, 2, 4]
    assert kvalloc.choose(sens, saved, 4.0, 3.4) == [0, 1, 2, 3, 4]
    with pytest.raises(ConvertError, match="below what the narrower type reaches"):
        kvalloc.choose(sens, saved, 4.0, 3.3)


def test_layer_spec_names_every_layer():
    hi, lo = kvalloc.HI, kvalloc.LO
    assert kvalloc.layer_spec(6, hi, lo, []) == f"*={hi}"
    assert kvalloc.layer_spec(6, hi, lo, [5, 0, 1, 3]) == f"*={hi},0-1={lo},3={lo},5={lo}"
    with pytest.raises(ValueError):
        kvalloc.layer_spec(6, hi, lo, [6])


@pytest.fixture(scope="module")
def smol_alloc(smol_cal, tmp_path_factory):
    """SmolLM2 (calibrated, 30 layers of 3 KV heads x 64) with an allocation measured on 1 chunk of 256 tokens."""
    from rotaryquant.converter.kcenter import rewrite_metadata
    from rotaryquant.data import calibration_text

    text = calibration_text().read_bytes()[:64 * 1024]
    a = kvalloc.measure(smol_cal, text, text_name="calib", target=3.6, chunks=1, n_ctx=256, threads=2,
                        progress=False)
    out = tmp_path_factory.mktemp("kvalloc") / "smol-alloc.gguf"
    rewrite_metadata(smol_cal, out, a.metadata(), drop_prefix=kvalloc.PREFIX, progress=False)
    return a, out


@pytest.mark.slow
def test_measure_meets_the_budget_and_the_sensitivities_are_real(smol_alloc, smol_cal):
    import llama_cpp

    from rotaryquant.bindings import type_from_name
    from rotaryquant.data import calibration_text
    from rotaryquant.eval.logits import kld_rows

    a, _ = smol_alloc
    assert len(a.sensitivity) == 30 and a.tokens == 128
    # on 64-wide heads the pairs are isoquant4_64/isoquant3_64: 4.25/3.25 bits, (4.25 + 3.25) / 2 = 3.75 at hi
    assert a.bits <= 3.6 + 1e-9 and a.bits > 3.25
    assert 0 < a.kld_hi < a.kld_lo
    assert a.lowered and a.spec.startswith(f"*={a.hi}")
    # one sensitivity, recomputed independently: llama_cpp.Llama over the same 256 tokens, numpy KLD rows
    il = max(range(30), key=lambda i: a.sensitivity[i])
    tok = llama_cpp.Llama(model_path=str(smol_cal), vocab_only=True, verbose=False)
    text = calibration_text().read_bytes()[:64 * 1024]
    ids = tok.tokenize(text, add_bos=True)[:256]  # BOS where the vocabulary adds one, as measure()

    def scores(tk, tv, layers=None):
        llm = llama_cpp.Llama(model_path=str(smol_cal), n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2,
                              verbose=False, logits_all=True, flash_attn=True, type_k=type_from_name(tk),
                              type_v=type_from_name(tv), kv_layer_types=layers)
        llm.eval(ids)
        return np.array(llm.scores[128:256], np.float64)

    ref = scores("f16", "f16")
    hi = kld_rows(ref, scores("isoquant4_0", "isoquant3_0")).mean()
    one = kld_rows(ref, scores("isoquant4_0", "isoquant3_0", f"{il}={a.lo}")).mean()
    np.testing.assert_allclose([hi, one - hi], [a.kld_hi, a.sensitivity[il]], rtol=1e-3, atol=1e-6)


@pytest.mark.slow
def test_the_runtime_uses_the_stored_allocation(bin_dir, smol_alloc, smol_cal):
    a, model = smol_alloc
    from rotaryquant.converter.kvalloc import read_allocation

    meta = read_allocation(model)
    assert meta["layer_types"] == a.spec and meta["version"] == kvalloc.FORMAT_VERSION

    def run(m, *extra):
        cmd = [str(bin_dir / "llama-completion"), "-m", str(m), "-p", PROMPT, "-n", "2", "-no-cnv", "-t", "2",
               "-c", "256", "--no-warmup", "-fa", "on", "-lv", "4", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    p = run(model, "--kv-layer-types", "model")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "per-layer K/V types from the model (rq-calibrate --kv-bits, " in p.stderr
    line = next(x for x in p.stderr.splitlines() if "per-layer K/V types (" in x)
    types = dict(item.split(":", 1) for item in line.split("): ", 1)[1].split())
    for il in range(30):
        k, v = types[str(il)].split("/")
        assert (k, v) == (("isoquant3_64" if il in a.lowered else "isoquant4_64"), "isoquant3_64"), (il, line)
    p = run(smol_cal, "--kv-layer-types", "model")
    assert p.returncode != 0 and "stores no per-layer K/V types; run rq-calibrate --kv-bits" in p.stderr


def test_a_budget_below_the_narrow_pair_is_refused(smollm2):
    with pytest.raises(ConvertError, match="below"):
        kvalloc.measure(smollm2, b"x" * 100, text_name="t", target=3.0, chunks=1, n_ctx=256, progress=False)
