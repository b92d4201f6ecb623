"""rotaryquant.kvtypes (checked against the library: bindings.validate_kv_spec) and the bench configurations: cache
specs with a +calib suffix."""

from __future__ import annotations

import pytest

from rotaryquant.bindings import RQTypeError, validate_kv_spec
from rotaryquant import kvtypes
from rotaryquant.eval import kvbench


def test_specs_split_and_carry_the_calibration_switch():
    assert kvtypes.split("q8_0/isoquant3_0+calib") == ("q8_0", "isoquant3_0")
    assert kvtypes.split("q4_0") == ("q4_0", "q4_0")
    assert kvtypes.k_center("isoquant3_0+calib") and not kvtypes.k_center("isoquant3_0")
    assert kvtypes.split("isoquant3_0+self") == ("isoquant3_0", "isoquant3_0") and kvtypes.k_center("q4_0+self")
    assert kvtypes.uses_iso("q8_0/isoquant3_0+calib") and not kvtypes.uses_iso("q4_0+calib")
    with pytest.raises(RQTypeError):
        validate_kv_spec("q5_9+calib")


def test_a_window_suffix_goes_anywhere_after_the_types():
    for spec in ("isoquant3_0+w16+calib", "isoquant3_0+calib+w16"):
        assert kvtypes.window(spec) == 16 and kvtypes.k_center(spec) and kvtypes.suffix(spec) == "+calib"
        assert kvtypes.split(spec) == ("isoquant3_0", "isoquant3_0")
    assert kvtypes.window("q8_0/isoquant3_0+w4@full=q8_0") == 4
    assert kvtypes.layer_types("q8_0/isoquant3_0+w4@full=q8_0") == "full=q8_0"
    assert kvtypes.window("isoquant3_0") == 0 and not kvtypes.k_center("isoquant3_0+w8")


def test_bench_configs_from_specs():
    assert kvbench.config("isoquant3_0-unfused") == ("isoquant3_0-unfused", "isoquant3_0", True)
    assert kvbench.config("q4_0+calib") == ("q4_0+calib", "q4_0+calib", False)


def test_iso_specs():
    assert kvtypes.split("isoquant4_0") == ("isoquant4_0", "isoquant4_0")
    assert kvtypes.split("isoquant4_0/isoquant3_0") == ("isoquant4_0", "isoquant3_0")
    assert kvtypes.uses_iso("q8_0/isoquant4_0") and kvtypes.uses_iso("isoquant3_0")
    assert not kvtypes.uses_iso("q8_0/q4_0")
    assert validate_kv_spec("isoquant4_0/isoquant3_0") == "isoquant4_0/isoquant3_0"
    with pytest.raises(RQTypeError):
        validate_kv_spec("isoquant5_0")

