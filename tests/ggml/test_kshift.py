"""Context shift (K-shift: dequantise, RoPE, requantise) with an isoquant3_0 K cache.

Upstream's shift path for quantised K assumes a Hadamard rotation; ours has none (the type rotates
itself). Measure what shifting costs against recomputing the same tokens from scratch, for
isoquant3_0 and for q8_0, on the real model; the shift must add little next to the type's own error.
"""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant import bindings
from rotaryquant.eval.logits import kld as _kld

pytestmark = pytest.mark.slow




def _scores(model, t, a, b, shift=None, kv_shift=None):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_threads=2, logits_all=True, verbose=False,
                          flash_attn=True, type_k=t, type_v=t)
    if shift is None:
        llm.eval(a + b)
        return np.array(llm.scores[len(a):len(a) + len(b)])
    kv_shift(llm, a, *shift)
    llm.eval(b)
    return np.array(llm.scores[llm.n_tokens - len(b):llm.n_tokens])


def test_shift_costs_little_next_to_the_types_own_error(gemma3, text_file, kv_shift):
    import llama_cpp

    text = text_file.read_text()[200_000:210_000]
    tok = llama_cpp.Llama(model_path=str(gemma3), vocab_only=True, verbose=False)
    ids = tok.tokenize(text.encode())
    a, b = ids[:300], ids[300:364]
    keep, nd = 4, 150
    retained = a[:keep] + a[keep + nd:]

    truth = _scores(gemma3, llama_cpp.GGML_TYPE_F16, retained, b)
    res = {}
    for name, t in (("q8_0", llama_cpp.GGML_TYPE_Q8_0), ("isoquant3_0", llama_cpp.GGML_TYPE_ISOQUANT3_0)):
        bindings.reset_counters()
        shifted = _scores(gemma3, t, a, b, shift=(keep, nd), kv_shift=kv_shift)
        deq = bindings.counters()["iso_dequant_rows"]
        fresh = _scores(gemma3, t, retained, b)
        res[name] = (_kld(truth, fresh), _kld(truth, shifted), deq)
    q8_fresh, q8_shift, _ = res["q8_0"]
    iso_fresh, iso_shift, iso_deq = res["isoquant3_0"]
    assert iso_deq > 0  # the shift really dequantised and requantised isoquant3_0 K rows
    # what shifting adds (one more requantisation of K after RoPE) is no worse than what it adds for
    # q8_0 (measured: +0.016 for q8_0, +0.008 for isoquant3_0); a broken shift (e.g. a missing or
    # wrong rotation) adds far more than that
    assert iso_shift - iso_fresh < (q8_shift - q8_fresh) + 0.03, res
    assert q8_shift - q8_fresh < 0.05, res
