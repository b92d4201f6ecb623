"""Fixtures shared by the numpy reference tests in tests/quants/."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def gauss():
    """4000 standard-normal rows of 128 float32 (the ISOQUANT block size), the same in every module."""
    return np.random.default_rng(1234).standard_normal((4000, 128)).astype(np.float32)
