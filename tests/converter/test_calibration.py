"""rq-convert --calibrate: the Gram collector, the one-pass flow, the statistics file, the refusals, and
calibration by default for recipes that emit ITQ3_S."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rotaryquant.converter import calibration as C
from rotaryquant.converter import kcenter
from rotaryquant.converter.cli import main as cli_main
from rotaryquant.converter.errors import ConvertError

TOKENS = "512"  # calibration tokens for the tests (kcenter.MIN_TOKENS is 256)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main([*argv, "--no-progress", "--table", "none"])
    out, err = capsys.readouterr()
    return rc, out, err


def _left(folder: Path) -> list[str]:
    """Everything but the files a test put there itself: temp, spill and calibration copies included."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- the accumulator -----------------------------------------------------------------------------------

def test_gram_blocks_match_numpy_over_batches():
    g = C.GramCollector.__new__(C.GramCollector)
    g.sums, g.tokens, g.seconds = {}, {}, 0.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 512)).astype(np.float32) * np.linspace(0.1, 3, 512, dtype=np.float32)
    g.add("w", x[:100])
    g.add("w", x[100:])
    x64 = x.astype(np.float64)
    for j in range(2):
        b = x64[:, j * 256:(j + 1) * 256]
        np.testing.assert_allclose(g.sums["w"][j], b.T @ b, rtol=1e-5, atol=1e-3)
    assert g.tokens["w"] == 300 and g.sums["w"].shape == (2, 256, 256)


def test_weight_names_are_filtered_like_llama_imatrix():
    assert C._weight_name("CUDA0#blk.0.attn_k.weight#0") == "blk.0.attn_k.weight"
    assert C._weight_name("blk.3.ffn_down.weight") == "blk.3.ffn_down.weight"


def _stats(**kw) -> C.Stats:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 256, 256)).astype(np.float32)
    base = dict(identity=C.Identity.of_tokens("llama", ["a", "b", "c"]), xtx={"blk.0.ffn_down.weight": a},
                group_of={"blk.0.ffn_down.weight": "blk.0.ffn_down.weight"},
                shapes={"blk.0.ffn_down.weight": (64, 512)}, tokens={"blk.0.ffn_down.weight": 300}, kcal=None,
                n_tokens=300, text_name="t.txt", text_sha256="0" * 64,
                model_tensors={"blk.0.ffn_down.weight": (64, 512), "blk.0.ffn_up.weight": (512, 64)})
    base.update(kw)
    return C.Stats(**base)


def test_stats_file_round_trips_and_refuses_other_models(tmp_path):
    s = _stats(kcal=kcenter.Calibration([0, 1], [np.ones((2, 4), np.float32)] * 2, [np.ones((2, 4), np.float32)] * 2,
                                        tokens=300, text_name="t.txt", text_sha256="0" * 64))
    p = s.save(tmp_path / "s.npz")
    t = C.Stats.load(p)
    np.testing.assert_array_equal(t.for_tensor("blk.0.ffn_down.weight"), s.xtx["blk.0.ffn_down.weight"])
    assert t.identity == s.identity and t.model_tensors == s.model_tensors and t.kcal.layers == [0, 1]
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]
    shapes = dict(s.model_tensors)
    t.check(s.identity, shapes, what="m.gguf")                       # the same model passes
    with pytest.raises(ConvertError, match="another vocabulary"):
        t.check(C.Identity.of_tokens("llama", ["a", "b", "d"]), shapes, what="m.gguf")
    with pytest.raises(ConvertError, match="for a llama model, m.gguf is qwen2"):
        t.check(C.Identity.of_tokens("qwen2", ["a", "b", "c"]), shapes, what="m.gguf")
    with pytest.raises(ConvertError, match="blk.0.ffn_up.weight is"):
        t.check(s.identity, {**shapes, "blk.0.ffn_up.weight": (256, 64)}, what="m.gguf")
    with pytest.raises(ConvertError, match="without tensor blk.1.ffn_up.weight"):
        t.check(s.identity, {**shapes, "blk.1.ffn_up.weight": (512, 64)}, what="m.gguf")
    with pytest.raises(ConvertError, match="must end in .npz"):
        s.save(tmp_path / "s.bin")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ConvertError, match="not a readable calibration file"):
        C.Stats.load(tmp_path / "bad.npz")


# --- errors through the CLI: exit code, message, nothing written ------------------------------------------

def _softcapped_gguf(path: Path) -> Path:
    """A GGUF whose K centring is refused (logit soft-capping) and whose weights are too narrow for ITQ3_S."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "gemma2")
    w.add_head_count(4)
    w.add_float32("gemma2.attn_logit_softcapping", 50.0)
    w.add_token_list(["a", "b"])
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_nothing_to_calibrate_is_an_error(tmp_path, capsys):
    src = _softcapped_gguf(tmp_path / "g2.gguf")
    out = tmp_path / "out" / "o.gguf"
    out.parent.mkdir()
    rc, _, err = _run(capsys, str(src), str(out), "--recipe", "q8_0", "--calibrate")
    assert rc == 1
    assert "nothing to calibrate" in err and "soft-capping" in err and "--recipe itq3" in err
    assert not out.exists() and _left(out.parent) == []


def test_short_calibration_text_is_an_error(tmp_path, capsys, smol_gguf):
    out = tmp_path / "out" / "o.gguf"
    out.parent.mkdir()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("To be, or not to be.")
    rc, _, err = _run(capsys, str(smol_gguf), str(out), "--recipe", "itq3", "--calibrate", str(tiny))
    assert rc == 1 and "tiny.txt is too short" in err and f"at least {kcenter.MIN_TOKENS} tokens" in err
    assert not out.exists() and _left(out.parent) == []
    # long enough in bytes, too short in tokens: found by the tokenizer, after loading the model
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question. " * 5)
    rc, _, err = _run(capsys, str(smol_gguf), str(out), "--recipe", "itq3", "--calibrate", str(short))
    assert rc == 1 and "short.txt is too short" in err and "tokens" in err
    assert not out.exists() and _left(out.parent) == []


def test_option_conflicts_exit_2(tmp_path, capsys, smol_gguf):
    out = tmp_path / "o.gguf"
    rc, _, err = _run(capsys, str(smol_gguf), str(out), "--calibrate", "--calibration-data", "x.npz")
    assert rc == 2 and "give one" in err
    rc, _, err = _run(capsys, str(smol_gguf), str(out), "--no-calibrate", "--calibrate")
    assert rc == 2 and "give one" in err
    # recipe rotaryquant emits no ITQ3_S, so nothing is calibrated and there is nothing to save
    rc, _, err = _run(capsys, str(smol_gguf), str(out), "--save-calibration", "x.npz")
    assert rc == 1 and "nothing to save" in err and "--calibrate" in err
    assert not out.exists() and not Path("x.npz").exists()


def test_interrupt_during_calibration_removes_every_temp_file(tmp_path, smol2_hf, monkeypatch):
    from rotaryquant.converter.convert import Options, convert

    seen = []

    def boom(model, *a, **k):
        seen.append(Path(model))
        assert Path(model).stat().st_size > 0      # the temporary Q8_0 conversion exists here
        raise KeyboardInterrupt

    monkeypatch.setattr(C, "collect", boom)
    out = tmp_path / "out" / "o.gguf"
    out.parent.mkdir()
    with pytest.raises(KeyboardInterrupt):
        convert(smol2_hf, out, Options(recipe="itq3", calibrate="", progress=False, calibration_tokens=512))
    assert seen and seen[0].parent == out.parent and seen[0].name.endswith(".tmp")
    assert not out.exists() and _left(out.parent) == []


# --- end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibrated(smol2_hf, tmp_path_factory):
    """SmolLM2 (2 layers, real weights; ffn_down's 1536 columns are the ITQ3_S tensors) converted with
    recipe itq3 and no calibration flag (so calibrated by default, on the packaged text), statistics saved."""
    d = tmp_path_factory.mktemp("cal")
    out, npz = d / "itq3-cal.gguf", d / "stats.npz"
    rc = cli_main([str(smol2_hf), str(out), "--recipe", "itq3", "--no-promote",
                   "--calibration-tokens", TOKENS, "--save-calibration", str(npz), "--no-progress", "--table", "none"])
    assert rc == 0
    return out, npz, d


def _weighted_error(w: np.ndarray, q: np.ndarray, xtx: np.ndarray) -> float:
    """sum_t |(W - Q) x_t|^2 restricted to the blocks: sum_b tr(E_b H_b E_b^T)."""
    e = (w - q).astype(np.float64)
    tot = 0.0
    for b in range(xtx.shape[0]):
        eb = e[:, b * 256:(b + 1) * 256]
        tot += float(np.einsum("ij,jk,ik->", eb, xtx[b].astype(np.float64), eb))
    return tot


def test_calibrated_itq3_differs_and_has_lower_output_error(calibrated, converted, smol2_hf, h):
    from rotaryquant.converter.gguf_source import dequantize

    out, npz, d = calibrated
    assert _left(d) == []                                    # no Q8_0 copy, temp or spill file left
    plain, _ = converted.get(smol2_hf, "itq3", promote=False)
    ref, _ = converted.get(smol2_hf, "f32")
    stats = C.Stats.load(npz)
    tc, tp, tr = h.tensors(out), h.tensors(plain), h.tensors(ref)
    itq3 = [n for n, t in tc.items() if t.tensor_type.name == "ITQ3_S"]
    assert itq3 == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    for n in itq3:
        assert tp[n].tensor_type.name == "ITQ3_S"
        assert not np.array_equal(h.raw_bytes(tc[n]), h.raw_bytes(tp[n])), n
        xtx = stats.for_tensor(n)
        assert xtx is not None and xtx.shape == (6, 256, 256) and stats.tokens[stats.group_of[n]] == int(TOKENS)
        w = dequantize(tr[n])
        e_cal, e_plain = _weighted_error(w, dequantize(tc[n]), xtx), _weighted_error(w, dequantize(tp[n]), xtx)
        assert e_cal < e_plain, (n, e_cal, e_plain)
    for n, t in tc.items():                                  # everything else is the plain conversion's
        if n not in itq3:
            assert np.array_equal(h.raw_bytes(t), h.raw_bytes(tp[n])), n
    cal = kcenter.read_calibration(out)
    assert cal is not None and list(cal["layers"]) == [0, 1] and cal["tokens"] == int(TOKENS)
    f = h.fields(out)
    assert f["rotaryquant.converter.calibrated"] == itq3
    assert len(h.greedy_tokens(out, n=4)) == 4              # llama.cpp loads and runs it


def test_saved_statistics_reproduce_the_file_and_are_refused_elsewhere(calibrated, tmp_path, capsys, smol2_hf,
                                                                       moe_hf):
    out, npz, _ = calibrated
    again = tmp_path / "again.gguf"
    rc, stdout, err = _run(capsys, str(smol2_hf), str(again), "--recipe", "itq3", "--no-promote",
                           "--calibration-data", str(npz))
    assert rc == 0, err
    assert again.read_bytes() == out.read_bytes()
    # another model (same tokenizer, other architecture and tensors): refused, nothing written
    bad = tmp_path / "bad.gguf"
    rc, _, err = _run(capsys, str(moe_hf), str(bad), "--recipe", "itq3", "--calibration-data", str(npz))
    assert rc == 1 and "calibration statistics" in err and "--calibrate TEXT" in err, err
    assert not bad.exists() and _left(tmp_path) == []
    # a vocabulary that differs in one token
    z = dict(np.load(npz))
    meta = json.loads(bytes(z["meta"]).decode())
    meta["vocab_sha256"] = "f" * 64
    z["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    other = tmp_path / "other.npz"
    np.savez(other, **z)
    rc, _, err = _run(capsys, str(smol2_hf), str(bad), "--recipe", "itq3", "--calibration-data", str(other))
    assert rc == 1 and "another vocabulary" in err
    assert not bad.exists() and _left(tmp_path) == []


def test_shared_inputs_share_one_accumulator_and_moe_experts_are_skipped(moe_hf, tmp_path):
    """Qwen2-MoE toy (256 wide): q/k/v read one tensor, so do the shared expert's gate/up; experts are
    MUL_MAT_ID and get no statistics (noted)."""
    from rotaryquant.converter.convert import Options, convert

    from rotaryquant.converter.calibrate_step import _gram_estimate, itq3_wanted

    out, npz = tmp_path / "o.gguf", tmp_path / "s.npz"
    res = convert(moe_hf, out, Options(recipe="itq3", promote=False, calibration_tokens=256,
                                       save_calibration=npz, progress=False))
    assert res.calibration_default and any("calibrated by default" in n for n in res.notes)
    s = C.Stats.load(npz)
    # what --dry-run announces: the weights and the pass's float64 bytes, grouped by shared input as measured
    assert _gram_estimate(res.planner, itq3_wanted(res.planner)) == (len(s.group_of), 2 * s.nbytes)
    for il in (0, 1):
        q = s.group_of[f"blk.{il}.attn_q.weight"]
        assert s.group_of[f"blk.{il}.attn_k.weight"] == q == s.group_of[f"blk.{il}.attn_v.weight"]
        gate = s.group_of[f"blk.{il}.ffn_gate_shexp.weight"]
        assert s.group_of[f"blk.{il}.ffn_up_shexp.weight"] == gate
        assert len({q, gate, s.group_of[f"blk.{il}.attn_output.weight"],
                    s.group_of[f"blk.{il}.ffn_down_shexp.weight"]}) == 4
        assert f"blk.{il}.ffn_down_exps.weight" not in s.group_of
    assert len(s.xtx) == 8 and set(s.tokens.values()) == {s.n_tokens}
    assert any("MoE expert" in n and "MUL_MAT_ID" in n for n in res.notes), res.notes
    assert set(res.calibrated) == set(s.group_of)
    assert _left(tmp_path) == []


def test_dry_run_announces_the_default_and_no_calibrate_is_the_plain_conversion(smol2_hf, converted, tmp_path,
                                                                                capsys):
    rc, out, _ = _run(capsys, str(smol2_hf), "--recipe", "itq3", "--no-promote", "--dry-run")
    assert rc == 0 and "would calibrate (the default for recipes that emit ITQ3_S; --no-calibrate skips it)" in out
    assert "Gram statistics for 2 ITQ3_S weight(s), about 6 MB" in out, out   # 2 x 1536 x 256 x 8 bytes
    for extra in (["--no-calibrate"], ["--recipe", "rotaryquant"]):
        rc, out, _ = _run(capsys, str(smol2_hf), "--recipe", "itq3", "--no-promote", "--dry-run", *extra)
        assert rc == 0 and "calibrate" not in out, out
    plain, _ = converted.get(smol2_hf, "itq3", promote=False)
    again = tmp_path / "plain.gguf"
    rc, out, _ = _run(capsys, str(smol2_hf), str(again), "--recipe", "itq3", "--no-promote", "--no-calibrate")
    assert rc == 0 and "calibrat" not in out and again.read_bytes() == plain.read_bytes()
