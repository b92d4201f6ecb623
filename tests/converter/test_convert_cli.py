"""rq-convert's --help documents every recipe's types; a missing output is a usage error."""

from __future__ import annotations

from rotaryquant.converter.cli import build_parser
from rotaryquant.converter.recipes import RECIPES


def test_help_lists_every_recipe_with_its_types():
    text = build_parser().format_help()
    for name, r in RECIPES.items():
        assert f"  {name} " in text
        t = r.table()
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("attention=") and
                    f"attention={t['attention']}," in ln and f"ffn_routed={t['ffn_routed']}," in ln)
        assert f"ffn_shared={t['ffn_shared']}" in line
    assert "--tensor-type" in text and "--kurtosis-threshold" in text and "--dry-run" in text
    assert "10.10" in text  # the paper's reference kappa


def test_no_output_is_a_usage_error(capsys):
    from rotaryquant.converter.cli import main

    assert main(["somewhere"]) == 2
    assert "no output file" in capsys.readouterr().err

