"""The numpy tensor backend runs upstream's per-architecture code with torch's results: for each
architecture in hf.NUMPY_VERIFIED a tiny random folder converts to F16 byte-identical to the vendored
convert_hf_to_gguf.py (real torch) and loads in the patched build."""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant.converter.hf import NUMPY_VERIFIED
from toy_archs import TOY_ARCHS, toy_folder  # tests/helpers


def test_verified_list_is_what_the_suite_checks():
    # Llama: test_convert_hf (SmolLM2); Qwen2-MoE: test_convert_moe; the rest: below
    assert NUMPY_VERIFIED == set(TOY_ARCHS) | {"LlamaForCausalLM", "Qwen2MoeForCausalLM"}


@pytest.mark.slow  # ~10-20 s each: upstream's run imports torch
@pytest.mark.parametrize("arch", TOY_ARCHS)
def test_f16_is_upstream(arch, smol2_hf, tmp_path_factory, converted, upstream_f16, h):
    folder = toy_folder(arch, tmp_path_factory.mktemp("toy") / arch, smol2_hf)
    ours, res = converted.get(folder, "f16")
    assert res.backend == "numpy" and not res.notes
    a, b = h.tensors(ours), h.tensors(upstream_f16(folder))
    assert list(a) == list(b)
    for n in a:
        assert a[n].tensor_type == b[n].tensor_type and np.array_equal(h.raw_bytes(a[n]), h.raw_bytes(b[n])), n
    q, _ = converted.get(folder, "rotaryquant-itq3")
    logits = h.forward_logits(q, "Hello there")
    assert np.isfinite(logits).all()
