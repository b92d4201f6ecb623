"""rotaryquant.eval.niah: needles are found at f16 on a short context; bad arguments are clear errors."""

from __future__ import annotations

import pytest

from rotaryquant import data
from rotaryquant.eval import niah

pytestmark = pytest.mark.slow


def test_finds_needles_at_f16_short_context(gemma3):
    res = niah.run(gemma3, data.evaluation_text(), cache_types=["f16"], ctxs=[1024], depths=[0.5],
                   progress=lambda *_: None)
    (row,) = res["rows"]
    assert row["asked"] == 4
    assert row["found"] >= 3, row["answers"]
    assert "| f16 | 1024 |" in niah.to_markdown(res)


def test_context_beyond_the_model_is_refused(smollm2):
    with pytest.raises(niah.NiahError, match="training context"):
        niah.run(smollm2, data.evaluation_text(), cache_types=["f16"], ctxs=[16384], depths=[0.5],
                 progress=lambda *_: None)
