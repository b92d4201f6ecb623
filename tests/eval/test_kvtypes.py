"""KV-cache type specs name both IsoQuant widths."""

from __future__ import annotations

import pytest

from rotaryquant.bindings import RQTypeError
from rotaryquant.eval import kvtypes


def test_iso_specs():
    assert kvtypes.split("isoquant4_0") == ("isoquant4_0", "isoquant4_0")
    assert kvtypes.split("isoquant4_0/isoquant3_0") == ("isoquant4_0", "isoquant3_0")
    assert kvtypes.uses_iso("q8_0/isoquant4_0") and kvtypes.uses_iso("isoquant3_0")
    assert not kvtypes.uses_iso("q8_0/q4_0")
    assert kvtypes.validate("isoquant4_0/isoquant3_0") == "isoquant4_0/isoquant3_0"
    with pytest.raises(RQTypeError):
        kvtypes.validate("isoquant5_0")
