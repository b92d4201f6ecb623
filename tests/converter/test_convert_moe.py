"""A tiny random Qwen2-MoE with a shared expert (made by the test): roles get their recipe types, the
kurtosis rule sees the heavy-tailed shared expert (kappa ~ 9.7, the paper's 10.10) and not the Gaussian
routed experts, the GGUF runs a forward pass in the patched build, and F16 equals upstream's output."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from rotaryquant.converter.qtypes import QT

OURS = "rotaryquant.converter."


def _types(h, path):
    return {n: t.tensor_type for n, t in h.tensors(path).items()}


def test_roles_and_types_rotaryquant(moe_hf, converted, h):
    out, res = converted.get(moe_hf, "rotaryquant")
    ty = _types(h, out)
    for b in (0, 1):
        for w in ("gate", "up", "down"):
            assert ty[f"blk.{b}.ffn_{w}_exps.weight"] == QT.Q2_K
            assert ty[f"blk.{b}.ffn_{w}_shexp.weight"] == QT.Q8_0
        for w in ("q", "k", "v", "output"):
            assert ty[f"blk.{b}.attn_{w}.weight"] == QT.Q4_K
        assert ty[f"blk.{b}.ffn_gate_inp.weight"] == QT.F32
        assert ty[f"blk.{b}.ffn_gate_inp_shexp.weight"] == QT.F32
        assert ty[f"blk.{b}.attn_q.bias"] == QT.F32
    assert ty["token_embd.weight"] == QT.Q4_K and ty["output.weight"] == QT.Q6_K
    by = {d.name: d for d in res.planner.decisions}
    for b in (0, 1):
        for w in ("gate", "up", "down"):
            assert 8.0 < by[f"blk.{b}.ffn_{w}_shexp.weight"].kurtosis < 12.0
            assert abs(by[f"blk.{b}.ffn_{w}_exps.weight"].kurtosis) < 0.5
    roles = dict(s.split("=", 1) for s in h.fields(out)[OURS + "role_types"])
    assert roles["ffn_routed"] == "q2_K" and roles["ffn_shared"] == "q8_0" and roles["attention"] == "q4_K"


def test_kurtosis_promotes_the_shared_expert_only(moe_hf, converted, h):
    """itq3 puts every linear weight at itq3_s; the heavy-tailed shared expert goes one step up."""
    out, res = converted.get(moe_hf, "itq3")
    ty = _types(h, out)
    promoted = sorted(d.name for d in res.planner.decisions if d.promoted)
    assert promoted == sorted(f"blk.{b}.ffn_{w}_shexp.weight" for b in (0, 1) for w in ("gate", "up", "down"))
    for n in promoted:
        assert ty[n] == QT.Q4_K
    assert all(ty[f"blk.{b}.ffn_{w}_exps.weight"] == QT.ITQ3_S for b in (0, 1) for w in ("gate", "up", "down"))
    assert all("kurtosis 9." in d.why or "kurtosis 1" in d.why for d in res.planner.decisions if d.promoted)
    assert sorted(h.fields(out)[OURS + "promoted"]) == promoted


def test_rotaryquant_itq3_roles(moe_hf, converted, h):
    ty = _types(h, converted.get(moe_hf, "rotaryquant-itq3")[0])
    assert ty["blk.0.attn_q.weight"] == QT.ITQ3_S
    assert ty["blk.0.ffn_up_exps.weight"] == QT.Q2_K
    assert ty["blk.0.ffn_up_shexp.weight"] == QT.Q8_0


@pytest.mark.parametrize("recipe", ["rotaryquant", "itq3", "rotaryquant-itq3"])
def test_forward_pass_in_patched_build(recipe, moe_hf, converted, h):
    out, _ = converted.get(moe_hf, recipe)
    logits = h.forward_logits(out)
    assert logits.shape[1] == 49152 and np.isfinite(logits).all() and logits.std() > 0
    ref = h.forward_logits(converted.get(moe_hf, "f16")[0])
    # a 2-layer random model: quantised logits stay close to the F16 ones
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.9


def test_f16_is_upstream_on_qwen2moe(moe_hf, converted, upstream_f16, h):
    ours, _ = converted.get(moe_hf, "f16")
    a, b = h.tensors(ours), h.tensors(upstream_f16(moe_hf))
    assert list(a) == list(b)
    for n in a:
        assert a[n].tensor_type == b[n].tensor_type and np.array_equal(h.raw_bytes(a[n]), h.raw_bytes(b[n])), n


def test_torch_backend_gives_the_same_file(moe_hf, converted, tmp_path, h):
    if not h.have_torch():
        pytest.skip("needs torch")
    ours, _ = converted.get(moe_hf, "rotaryquant-itq3")
    out = tmp_path / "torch.gguf"
    p = subprocess.run([sys.executable, "-m", "rotaryquant.converter.cli", str(moe_hf), str(out), "--recipe",
                        "rotaryquant-itq3", "--tensor-backend", "torch", "--no-calibrate", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "torch backend" in p.stdout
    a, b = h.tensors(ours), h.tensors(out)
    assert list(a) == list(b)
    for n in a:
        assert np.array_equal(h.raw_bytes(a[n]), h.raw_bytes(b[n])), n
