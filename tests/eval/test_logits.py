"""rotaryquant.eval.logits: KL divergence of logits."""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant.eval.logits import kld


def test_kld_of_logits():
    a = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    assert kld(a, a) == 0.0
    p, q = np.exp(a) / np.exp(a).sum(1, keepdims=True), np.full((2, 3), 1 / 3)
    assert kld(a, np.zeros_like(a)) == pytest.approx(float((p * np.log(p / q)).sum(1).mean()))
