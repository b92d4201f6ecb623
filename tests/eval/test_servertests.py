"""rotaryquant.eval.servertests: upstream's own server tests on the patched llama-server, a fast subset.

The subset: tests that passed in all three configurations of the full run and touch our cache beyond a plain
completion (the prompt cache kept for inactive slots, /metrics); it runs with the isoquant3_0 cache and with
deferred prefill. Upstream's slot-save and context-shift tests assert stories260K's text and token counts. `rq-eval server-tests` runs the whole suite (docs/results/
server-upstream-tests.md)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rotaryquant.eval import servertests as st

pytestmark = pytest.mark.slow

SUBSET = [
    "test_kv_keep_only_active.py::test_clear_and_restore",
    "test_metrics.py::test_metrics_prompt_processed_and_cached",
    "test_metrics.py::test_metrics_slots_idle_after_completion",
    "test_basic.py::test_server_props",
]


def test_shim_parses_junit(tmp_path: Path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="unit.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="unit.test_a" name="test_bad[x]" time="2"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="unit.test_b" name="test_skip" time="0"><skipped message="hub model m"/></testcase>'
        '<testcase classname="" name="unit.test_c" time="0"><error message="collection failure"/></testcase>'
        '</testsuite></testsuites>')
    cases = st.parse_junit(xml)
    assert [(c.file, c.outcome) for c in cases] == [("test_a.py", "passed"), ("test_a.py", "failed"),
                                                    ("test_b.py", "skipped"), ("test_c.py", "failed")]
    assert cases[1].message == "assert 1 == 2" and cases[1].id == "test_a.py::test_bad[x]"


@pytest.mark.parametrize("config", ["isoquant3_0", "isoquant3_0-deferred"])
def test_upstream_server_subset_passes(config, bin_dir):
    res = st.run([config], select=SUBSET, progress=lambda *_: None)
    cases = res["configs"][0]["cases"]
    n = Counter(c["outcome"] for c in cases)
    assert n["passed"] == len(SUBSET), json.dumps([c for c in cases if c["outcome"] != "passed"], indent=1)
    assert "| test_metrics.py | 2 / 0 / 0 |" in st.to_markdown(res)
