"""rotaryquant.eval.gate: the checks themselves, and a short real run."""

from __future__ import annotations

import pytest

from rotaryquant.eval import gate


def test_data_file_has_the_papers_twelve_prompts():
    spec = gate.load_spec()
    suites = [p["suite"] for p in spec["prompts"]]
    assert suites.count("default") == 5 and suites.count("coding") == 7
    assert spec["max_repetition"] == 0.22


def test_flags_a_degenerate_repetitive_answer():
    spec = gate.load_spec()
    item = spec["prompts"][0]
    loop = "Paris is on the Seine. " + "the river the river the river " * 20
    c = gate.check_answer(item, loop, spec)
    assert not c.passed and c.repetition > 0.22
    good = "The capital of France is Paris. The river Seine flows through the city from east to west, " \
           "past the islands at its centre."
    assert gate.check_answer(item, good, spec).passed


def test_missing_substring_and_unbalanced_fences_fail():
    spec = gate.load_spec()
    code_item = next(p for p in spec["prompts"] if p["id"] == "code-python-reverse")
    text = "Here is the function you asked for, it reverses the input string quickly:\n```python\ndef rev(s):\n    return s[::-1]\n"
    c = gate.check_answer(code_item, text, spec)
    assert not c.fences_ok and not c.passed
    c = gate.check_answer(spec["prompts"][0], "The capital city of France is Paris, a large and famous city in Europe.", spec)
    assert c.missing == ["Seine"] and not c.passed


def test_repetition_rate_bounds():
    assert gate.repetition_rate("") == 0.0
    assert gate.repetition_rate("one two three four five six") == 0.0
    assert gate.repetition_rate("a b c a b c a b c a b c") > 0.5


@pytest.mark.slow
def test_real_run_on_the_instruction_model(smollm2):
    res = gate.run(smollm2, cache_type="f16", max_tokens=48, progress=lambda *_: None)
    assert res["total"] == 12 and 0 <= res["passed"] <= 12
    assert all(c["words"] > 0 for c in res["checks"])
    md = gate.to_markdown([res])
    assert md.count("\n| ") >= 13
