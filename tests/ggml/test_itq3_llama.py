"""ITQ3_S through llama-quantize on a real model: quantise, load, generate."""

from __future__ import annotations

import subprocess

import pytest

import gguf

pytestmark = pytest.mark.slow


def _quantize(bin_dir, src, dst, *args):
    proc = subprocess.run([str(bin_dir / "llama-quantize"), *map(str, args[:-1]), str(src), str(dst), str(args[-1])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _generate(bin_dir, model):
    proc = subprocess.run([str(bin_dir / "llama-completion"), "-m", str(model), "-p", "The history of the printing press",
                           "-n", "32", "--temp", "0", "-no-cnv", "-t", "2", "--no-warmup", "--no-display-prompt"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_positional_ftype_itq3_s(bin_dir, smollm2_f16, tmp_path, sane_text):
    out = tmp_path / "itq3.gguf"
    log = _quantize(bin_dir, smollm2_f16, out, "ITQ3_S")
    # 1536-wide ffn_down rows take ITQ3_S; 576-wide rows are not divisible by 256 and fall back
    assert "converting to itq3_s" in log
    assert "falling back to  iq4_nl" in log or "falling back to iq4_nl" in log
    r = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.ITQ3_S
    assert r.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_ITQ3_S
    assert sane_text(_generate(bin_dir, out))


def test_tensor_type_override(bin_dir, smollm2_f16, tmp_path, sane_text):
    out = tmp_path / "q8-itq3.gguf"
    _quantize(bin_dir, smollm2_f16, out, "--tensor-type", "ffn_down=itq3_s", "Q8_0")
    r = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.5.ffn_down.weight"] == gguf.GGMLQuantizationType.ITQ3_S
    assert types["blk.5.ffn_up.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert sane_text(_generate(bin_dir, out))
