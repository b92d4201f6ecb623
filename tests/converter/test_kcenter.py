"""rq-calibrate's library without a model: the statistics, the metadata rewrite and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rotaryquant.converter import kcenter
from rotaryquant.converter.calibrate_cli import main as cli_main
from rotaryquant.converter.errors import ConvertError


def _gguf(path: Path, arch: str = "llama", extra: dict | None = None, head_count: bool = True) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    if head_count:
        w.add_head_count(4)
    w.add_string("general.name", "tiny")
    for k, v in (extra or {}).items():
        if isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((5, 64)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_layer_stats_match_numpy_and_map_query_heads_to_their_kv_head():
    rng = np.random.default_rng(1)
    T, nkv, g, hd = 50, 2, 3, 8
    k = rng.standard_normal((T, nkv, hd)) * 3 + rng.standard_normal((1, nkv, hd)) * 10
    q = rng.standard_normal((T, nkv * g, hd))
    q[:, 5, 0] = 100.0  # query head 5 belongs to KV head 1 (5 // 3), channel 0
    st = kcenter.LayerStats(nkv, hd)
    st.add_k(k[:20].astype(np.float32))
    st.add_k(k[20:].astype(np.float32))
    st.add_q(q.astype(np.float32))
    mu, lam = st.derive()
    k32 = k.astype(np.float32).astype(np.float64)
    ref_mu = k32.mean(0)
    np.testing.assert_allclose(mu, ref_mu, rtol=1e-6, atol=1e-6)
    qmax = np.abs(q.astype(np.float32)).reshape(T, nkv, g, hd).max(axis=(0, 2))
    assert qmax[1, 0] == 100.0 and qmax[0, 0] < 100.0
    ref_lam = np.sqrt(np.abs(k32 - ref_mu).max(0) / qmax)
    np.testing.assert_allclose(lam, ref_lam, rtol=1e-5)


def test_rewrite_keeps_tensors_and_replaces_old_calibration(tmp_path):
    from gguf import GGUFReader

    src = _gguf(tmp_path / "m.gguf")
    mid, dst = tmp_path / "mid.gguf", tmp_path / "out.gguf"
    kcenter.rewrite_metadata(src, mid, {kcenter.PREFIX + "version": 1, kcenter.PREFIX + "mean":
                                        np.arange(6, dtype=np.float32), kcenter.PREFIX + "text": "x"}, progress=False)
    kcenter.rewrite_metadata(mid, dst, {kcenter.PREFIX + "version": 1, kcenter.PREFIX + "layers":
                                        np.array([0, 2], np.int32)}, progress=False)
    a, b = GGUFReader(src), GGUFReader(dst)
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.name == tb.name and ta.tensor_type == tb.tensor_type
        assert bytes(ta.data.tobytes()) == bytes(tb.data.tobytes())
    assert b.fields["general.name"].contents() == "tiny"
    cal = kcenter.read_calibration(dst)
    assert cal == {"version": 1, "layers": [0, 2]}  # the first run's mean/text are gone
    assert not list(tmp_path.glob(".*partial"))


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(ConvertError, match="soft-capping"):
        kcenter.check_model(_gguf(tmp_path / "g2.gguf", "gemma2", {"gemma2.attn_logit_softcapping": 50.0}))
    with pytest.raises(ConvertError, match="soft-capping"):
        kcenter.check_model(_gguf(tmp_path / "x.gguf", "llama", {"llama.attn_logit_softcapping": 30.0}))
    with pytest.raises(ConvertError, match="MLA"):
        kcenter.check_model(_gguf(tmp_path / "d.gguf", "deepseek2", {"deepseek2.attention.kv_lora_rank": 512}))
    with pytest.raises(ConvertError, match="no attention layers"):
        kcenter.check_model(_gguf(tmp_path / "r.gguf", "mamba", head_count=False))
    assert kcenter.check_model(_gguf(tmp_path / "ok.gguf")) == "llama"


def test_unhooked_refusal_reads_the_library_list(tmp_path):
    # one list, in C (llama_rq_unhooked_archs): every name of it is refused, a name not on it is not
    from rotaryquant import bindings

    archs = bindings.unhooked_archs()
    assert archs and not hasattr(kcenter, "_UNHOOKED_ARCHS")
    for arch in archs:
        with pytest.raises(ConvertError, match=f"{arch} writes or reuses its K cache"):
            kcenter.check_model(_gguf(tmp_path / f"{arch}.gguf", arch))
    assert "qwen2" not in archs and kcenter.check_model(_gguf(tmp_path / "qwen2.gguf", "qwen2")) == "qwen2"
    # MLA is decided from the GGUF (the runtime: hparams.is_mla()), whatever the architecture
    for key in ("attention.kv_lora_rank", "attention.key_length_mla"):
        with pytest.raises(ConvertError, match="MLA"):
            kcenter.check_model(_gguf(tmp_path / "mla.gguf", "qwen2", {f"qwen2.{key}": 512}))


def test_short_text_is_refused():
    with pytest.raises(ConvertError, match="too short: 10 tokens"):
        kcenter.text_tokens(b"x" * 10, lambda b: list(b), 4096, "t.txt")
    assert len(kcenter.text_tokens(b"x" * 1000, lambda b: list(b), 300, "t.txt")) == 300


def test_cli_errors_exit_1_and_write_nothing(tmp_path, capsys):
    m = _gguf(tmp_path / "g2.gguf", "gemma2", {"gemma2.attn_logit_softcapping": 50.0})
    before = m.read_bytes()
    out = tmp_path / "out.gguf"
    assert cli_main([str(m), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rq-calibrate: error:") and "soft-capping" in err
    assert not out.exists() and m.read_bytes() == before
    assert cli_main([str(tmp_path / "missing.gguf")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli_main([str(_gguf(tmp_path / "ok.gguf")), "--tokens", "10"]) == 1
    assert "below the minimum" in capsys.readouterr().err
