"""rotaryquant.eval.niah: needles are found at f16 on a short context; bad arguments are clear errors."""

from __future__ import annotations

import pytest

from rotaryquant import data
from rotaryquant.eval import niah

pytestmark = pytest.mark.slow


def test_finds_needles_at_f16_short_context(gemma3):
    res = niah.run(gemma3, data.evaluation_text(), cache_types=["f16"], ctxs=[1024], depths=[0.5], seeds=(42, 7),
                   n_needles=6, progress=lambda *_: None)
    a, b = res["rows"]
    assert (a["seed"], b["seed"], a["asked"], b["bits_per_value"]) == (42, 7, 6, 16.0)
    assert a["found"] >= 5 and b["found"] >= 5, (a["answers"], b["answers"])
    assert res["needles"][42] != res["needles"][7]  # another seed asks for other numbers ...
    assert niah.haystack_offset(7, 10**6, 1024) != niah.haystack_offset(42, 10**6, 1024)  # ... in other text
    assert f"| f16 | 16.000 | 1024 | {a['found'] + b['found']}/12 | {a['found'] + b['found']}/12 |" in niah.to_markdown(res)


def test_context_beyond_the_model_is_refused(smollm2):
    with pytest.raises(niah.NiahError, match="training context"):
        niah.run(smollm2, data.evaluation_text(), cache_types=["f16"], ctxs=[16384], depths=[0.5],
                 progress=lambda *_: None)
