"""Gemma3-270M (no HF folder exists here): the GGUF-input path requantises it and it still answers."""

from __future__ import annotations

import pytest

from rotaryquant.converter.convert import Options, convert
from rotaryquant.converter.qtypes import QT

pytestmark = pytest.mark.slow


def test_gemma3_gguf_to_rotaryquant_itq3_generates(gemma3, tmp_path, h):
    import llama_cpp

    out = tmp_path / "g3.gguf"
    res = convert(gemma3, out, Options(recipe="rotaryquant-itq3", progress=False))
    ts = h.tensors(out)
    assert ts["token_embd.weight"].tensor_type == QT.Q8_0     # tied, 640 % 256 -> llama.cpp's q8_0
    assert ts["blk.0.ffn_down.weight"].tensor_type in (QT.ITQ3_S, QT.Q4_K)   # 2048 columns fit 256-blocks
    assert any(d.promoted for d in res.planner.decisions)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, verbose=False)
    text = llm("The capital of France is", max_tokens=16, temperature=0)["choices"][0]["text"]
    llm.close()
    assert len(text.split()) >= 3, text
