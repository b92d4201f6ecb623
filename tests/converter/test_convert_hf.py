"""rq-convert on an HF folder rebuilt from the packaged SmolLM2 (2 real layers): every recipe converts,
loads and generates in the patched llama.cpp; F16 equals upstream convert_hf_to_gguf; quantised bytes
are exactly ggml's / our numpy quantiser's; streaming, dry run, overrides, imatrix, GGUF input."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from rotaryquant import bindings
from rotaryquant.converter import qtypes
from rotaryquant.converter import roles as R
from rotaryquant.converter.cli import main as cli_main
from rotaryquant.converter.convert import Options, convert
from rotaryquant.converter.qtypes import QT
from rotaryquant.converter.recipes import RECIPES
from rotaryquant.quants import itq3

OURS = "rotaryquant.converter."


def _source_f32(folder, hf_name):
    """One tensor of the HF folder as float32 (BF16 widened), read straight from the safetensors file."""
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    path = folder / idx[hf_name]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])[hf_name]
    b, e = meta["data_offsets"]
    bits = np.frombuffer(raw[8 + n + b:8 + n + e], dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(meta["shape"])


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_converts_loads_and_generates(recipe, smol2_hf, converted, h):
    out, res = converted.get(smol2_hf, recipe)
    ts = h.tensors(out)
    pl = res.planner
    assert [d.name for d in pl.decisions] == list(ts)
    for d in pl.decisions:
        assert ts[d.name].tensor_type == d.qtype, d.name
        if d.role in R.KEPT_F32:
            assert d.qtype == QT.F32
    f = h.fields(out)
    assert f[OURS + "recipe"] == recipe
    assert f[OURS + "version"].startswith("rq-convert ")
    assert f["general.file_type"] == int(qtypes.file_type_for(pl.weights_per_type()))
    roles = dict(s.split("=", 1) for s in f[OURS + "role_types"])
    assert set(roles) == {d.role for d in pl.decisions}
    toks = h.greedy_tokens(out, n=6)
    assert len(toks) == 6 and all(0 <= t < 49152 for t in toks)
    assert not list(out.parent.glob(".*.tmp")) and not list(out.parent.glob(".*.data"))


def test_recipe_types_on_smollm2(smol2_hf, converted, h):
    """Per role as specified, with llama.cpp's fallback where 576-wide rows fit no 256-block."""
    ts = h.tensors(converted.get(smol2_hf, "rotaryquant", promote=False)[0])
    assert ts["token_embd.weight"].tensor_type == QT.Q8_0        # tied -> output rule, 576 % 256 -> q8_0
    assert ts["blk.0.ffn_down.weight"].tensor_type == QT.Q4_K     # 1536 columns
    assert ts["blk.0.attn_q.weight"].tensor_type == QT.Q5_0       # q4_K -> q5_0 fallback
    assert ts["blk.0.attn_norm.weight"].tensor_type == QT.F32
    ts = h.tensors(converted.get(smol2_hf, "itq3", promote=False)[0])
    assert ts["blk.1.ffn_down.weight"].tensor_type == QT.ITQ3_S
    assert ts["blk.1.ffn_up.weight"].tensor_type == QT.IQ4_NL      # itq3_s -> iq4_nl fallback


def test_f16_is_upstream_convert_hf_to_gguf(smol2_hf, converted, upstream_f16, h):
    ours, _ = converted.get(smol2_hf, "f16")
    theirs = upstream_f16(smol2_hf)
    a, b = h.tensors(ours), h.tensors(theirs)
    assert list(a) == list(b)
    for n in a:
        assert a[n].tensor_type == b[n].tensor_type and np.array_equal(h.raw_bytes(a[n]), h.raw_bytes(b[n])), n
    fa, fb = h.fields(ours), h.fields(theirs)
    assert {k for k in fa if not k.startswith(OURS)} == set(fb)
    for k in fb:
        if k != "GGUF.kv_count":
            assert fa[k] == fb[k], k
    assert h.greedy_tokens(ours) == h.greedy_tokens(theirs)


@pytest.mark.slow
def test_full_smollm2_f16_greedy_matches_upstream_and_generates(smol_full_hf, converted, upstream_f16, h):
    ours, _ = converted.get(smol_full_hf, "f16")
    theirs = upstream_f16(smol_full_hf)
    toks = h.greedy_tokens(ours, n=16)
    assert toks == h.greedy_tokens(theirs, n=16)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(ours), n_ctx=256, n_threads=2, verbose=False)
    text = llm.detokenize(toks).decode(errors="replace")
    llm.close()
    assert "Paris" in text


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rotaryquant", "itq3", "rotaryquant-itq3"])
def test_full_smollm2_recipes_generate_sane_text(recipe, smol_full_hf, converted, h):
    import llama_cpp

    out, _ = converted.get(smol_full_hf, recipe)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, verbose=False)
    text = llm("The capital of France is", max_tokens=24, temperature=0)["choices"][0]["text"]
    llm.close()
    words = text.split()
    assert len(words) >= 5 and sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.7, text


def test_itq3_round_trip(smol2_hf, converted, h):
    """ITQ3_S tensors written by the converter: our numpy quantiser's bytes, and C and numpy decode them
    to the same floats."""
    out, _ = converted.get(smol2_hf, "itq3", promote=False)
    ts = h.tensors(out)
    itq = [n for n, t in ts.items() if t.tensor_type == QT.ITQ3_S]
    assert itq
    for n in itq:
        raw = np.asarray(ts[n].data, dtype=np.uint8)
        cols = int(ts[n].shape[0])
        c = bindings.dequantize(raw, int(QT.ITQ3_S), cols)
        py = itq3.dequantize_rows(raw)
        assert np.array_equal(c.view(np.uint32), py.view(np.uint32)), n
        bid = n.split(".")[1]
        src = _source_f32(smol2_hf, f"model.layers.{bid}.mlp.down_proj.weight")
        assert np.array_equal(raw, itq3.quantize_rows(src)), n
        assert np.abs(py - src).max() < 0.5 * np.abs(src).max()


def test_ggml_types_are_ggml_quantiser_bytes(smol2_hf, converted, h):
    ts = h.tensors(converted.get(smol2_hf, "rotaryquant", promote=False)[0])
    src = _source_f32(smol2_hf, "model.layers.1.mlp.down_proj.weight")
    assert np.array_equal(np.asarray(ts["blk.1.ffn_down.weight"].data), bindings.quantize(src, int(QT.Q4_K)))
    src = _source_f32(smol2_hf, "model.layers.1.mlp.up_proj.weight")
    assert np.array_equal(np.asarray(ts["blk.1.ffn_up.weight"].data), bindings.quantize(src, int(QT.Q5_0)))


def test_streaming_keeps_no_tensor_data_in_memory(smol2_hf, tmp_path, monkeypatch):
    from rotaryquant.converter.writer import StreamingWriter

    seen = []
    orig = StreamingWriter.add_tensor

    def spy(self, name, tensor, *a, **k):
        orig(self, name, tensor, *a, **k)
        seen.append(name)
        held = [n for shard in self.tensors for n, ti in shard.items() if ti.tensor is not None]
        assert held == [], f"tensor data kept in memory after {name}: {held}"

    monkeypatch.setattr(StreamingWriter, "add_tensor", spy)
    convert(smol2_hf, tmp_path / "s.gguf", Options(recipe="rotaryquant-itq3", progress=False, auto_calibrate=False))
    assert len(seen) == 20


def test_threads_do_not_change_the_output(smol2_hf, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert(smol2_hf, a, Options(recipe="rotaryquant-itq3", threads=1, progress=False, auto_calibrate=False))
    convert(smol2_hf, b, Options(recipe="rotaryquant-itq3", threads=2, progress=False, auto_calibrate=False))
    assert a.read_bytes() == b.read_bytes()


def test_cli_dry_run_prints_plan_and_writes_nothing(smol2_hf, tmp_path, capsys):
    out = tmp_path / "never.gguf"
    assert cli_main([str(smol2_hf), str(out), "--dry-run", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert "tensor" in text and "why" in text and "dry run: nothing written" in text
    assert "blk.0.attn_q.weight" in text and "kurtosis" in text and "recipe rotaryquant" in text


def test_cli_overrides_and_table(smol2_hf, tmp_path, capsys, h):
    out = tmp_path / "o.gguf"
    rc = cli_main([str(smol2_hf), str(out), "--recipe", "itq3", "--no-progress", "--no-promote", "--no-calibrate",
                   "--tensor-type", "attn_v=q8_0", "--tensor-type", "BLK\\.1\\.ffn_down=q6_k"])
    assert rc == 0
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask   # a new file's mode, not the temp file's 0600
    text = capsys.readouterr().out
    ts = h.tensors(out)
    assert ts["blk.0.attn_v.weight"].tensor_type == QT.Q8_0
    assert ts["blk.1.ffn_down.weight"].tensor_type == QT.Q6_K
    assert ts["blk.0.ffn_down.weight"].tensor_type == QT.ITQ3_S
    assert "--tensor-type attn_v=q8_0" in text and "overridden: 3" in text
    f = h.fields(out)
    assert f[OURS + "tensor_types"] == ["attn_v=q8_0", "blk\\.1\\.ffn_down=q6_K"]


def test_kurtosis_promotion_on_real_weights(smol2_hf, converted, h):
    """SmolLM2's layer-0 attention has heavy-tailed weights: those tensors are promoted and recorded."""
    out, res = converted.get(smol2_hf, "rotaryquant")
    promoted = [d for d in res.planner.decisions if d.promoted]
    assert promoted and all(d.kurtosis > 5.0 for d in promoted)
    assert all(d.kurtosis <= 5.0 for d in res.planner.decisions if d.kurtosis is not None and not d.promoted)
    assert sorted(h.fields(out)[OURS + "promoted"]) == sorted(d.name for d in promoted)


def test_imatrix_weights_quantisers_and_drives_activation_kurtosis(smol2_hf, tmp_path, h):
    rng = np.random.default_rng(5)
    down = (rng.random((1, 1536)) + 0.5) * 2048
    outlier = np.ones((1, 1536)) * 2048
    outlier[0, 7] *= 5000
    h.write_imatrix(tmp_path / "im.gguf", {"blk.1.ffn_down.weight": (down, np.array([2048])),
                                          "blk.0.ffn_down.weight": (outlier, np.array([2048]))})
    out = tmp_path / "im-out.gguf"
    res = convert(smol2_hf, out, Options(recipe="rotaryquant", imatrix=tmp_path / "im.gguf", progress=False))
    ts = h.tensors(out)
    src = _source_f32(smol2_hf, "model.layers.1.mlp.down_proj.weight")
    want = bindings.quantize(src, int(QT.Q4_K), (down[0] / 2048).astype(np.float32))
    assert np.array_equal(np.asarray(ts["blk.1.ffn_down.weight"].data), want)
    d0 = next(d for d in res.planner.decisions if d.name == "blk.0.ffn_down.weight")
    assert d0.act_kurtosis > 100 and d0.promoted and "activation kurtosis" in d0.why
    assert ts["blk.0.ffn_down.weight"].tensor_type == QT.Q6_K
    assert h.fields(out)[OURS + "imatrix"] == "im.gguf"


def test_real_llama_imatrix_file_is_accepted(smol2_hf, converted, tmp_path, h):
    """An imatrix written by the patched llama-imatrix itself (on the F16 conversion) is read and used."""
    import subprocess

    f16, _ = converted.get(smol2_hf, "f16")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    im = tmp_path / "imatrix.gguf"
    p = subprocess.run([str(bindings.binary("llama-imatrix")), "-m", str(f16), "-f", str(text), "-o", str(im),
                        "-c", "128", "--chunks", "2", "-t", "2", "--no-ppl"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and im.exists(), p.stderr[-2000:]
    out = tmp_path / "with-im.gguf"
    res = convert(smol2_hf, out, Options(recipe="rotaryquant-itq3", imatrix=im, progress=False, auto_calibrate=False))
    got = {d.name: d.act_kurtosis for d in res.planner.decisions if d.act_kurtosis is not None}
    assert "blk.0.attn_q.weight" in got and "blk.1.ffn_down.weight" in got
    assert len(h.greedy_tokens(out, n=4)) == 4


def test_gguf_input_requantises_like_the_hf_path(smol2_hf, converted, tmp_path, h):
    """HF -> f32 GGUF -> rotaryquant equals HF -> rotaryquant, tensor for tensor (f32 is lossless)."""
    f32, _ = converted.get(smol2_hf, "f32")
    direct, _ = converted.get(smol2_hf, "rotaryquant-itq3")
    out = tmp_path / "req.gguf"
    res = convert(f32, out, Options(recipe="rotaryquant-itq3", progress=False, auto_calibrate=False))
    assert res.kind == "gguf"
    a, b = h.tensors(out), h.tensors(direct)
    assert list(a) == list(b)
    for n in a:
        assert a[n].tensor_type == b[n].tensor_type and np.array_equal(h.raw_bytes(a[n]), h.raw_bytes(b[n])), n
    fa, fb = h.fields(out), h.fields(direct)
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.block_count", "general.file_type"):
        assert fa[k] == fb[k], k
    assert fa[OURS + "source"] == f32.name   # same tensors and metadata: the same model for llama.cpp


def test_gguf_input_decodes_itq3_and_packaged_quant_types(smol2_hf, converted, tmp_path, h):
    itq, _ = converted.get(smol2_hf, "itq3", promote=False)
    out = tmp_path / "back-f32.gguf"
    convert(itq, out, Options(recipe="f32", progress=False))
    a, b = h.tensors(out), h.tensors(itq)
    for n, t in b.items():
        if t.tensor_type == QT.ITQ3_S:
            want = itq3.dequantize_rows(np.asarray(t.data, dtype=np.uint8))
            assert np.array_equal(np.asarray(a[n].data).reshape(want.shape), want), n


@pytest.mark.slow
def test_packaged_q4_1_gguf_requantises_and_generates(smol_gguf, tmp_path, h):
    import llama_cpp

    out = tmp_path / "smol-rq.gguf"
    res = convert(smol_gguf, out, Options(recipe="rotaryquant", progress=False))
    assert res.kind == "gguf" and res.n_weights > 130e6
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, verbose=False)
    text = llm("The capital of France is", max_tokens=16, temperature=0)["choices"][0]["text"]
    llm.close()
    assert "Paris" in text, text
