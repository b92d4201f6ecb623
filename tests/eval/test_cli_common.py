"""rotaryquant.eval.cli_common: where -o STEM writes, whole files only."""

from __future__ import annotations

import json
from pathlib import Path

from rotaryquant.eval.cli_common import result_file, write


def test_a_stem_with_a_dot_keeps_it(tmp_path: Path) -> None:
    # three runs at needle depths 0.1, 0.5 and 0.9 once all wrote needles-0.json
    assert result_file(tmp_path / "needles-0.1", ".json").name == "needles-0.1.json"
    assert result_file(tmp_path / "needles-0.5", ".md").name == "needles-0.5.md"
    assert result_file(tmp_path / "kv.json", ".md").name == "kv.md"  # a suffix given is the stem's own
    for d in ("0.1", "0.5"):
        write(tmp_path / f"needles-{d}", {"d": d}, f"# {d}\n", echo=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["needles-0.1.json", "needles-0.1.md", "needles-0.5.json",
                                                         "needles-0.5.md"]  # and no partial file left
    assert json.loads((tmp_path / "needles-0.5.json").read_text()) == {"d": "0.5"}
