"""rotaryquant.eval is a leaf: the core package, the converter and the bindings never import it; only the
command lines over it do (rq-eval/rq-bench are eval's own; `rq-plan verify`, `make demo`)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# command lines, not libraries (plan_verify: rq-plan --verify, which measures the planner with eval's server)
ALLOWED = {"rotaryquant/demo.py", "rotaryquant/plan_cli.py", "rotaryquant/plan_verify.py"}


def _imports_eval(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "rotaryquant.eval" or node.module.startswith("rotaryquant.eval."):
                return True
            if node.module == "rotaryquant" and any(a.name == "eval" for a in node.names):
                return True
        if isinstance(node, ast.Import) and any(a.name.startswith("rotaryquant.eval") for a in node.names):
            return True
    return False


def test_nothing_outside_eval_imports_it():
    offenders = []
    for top in ("rotaryquant", "converter", "bindings"):
        for f in sorted((REPO / top).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel not in ALLOWED and _imports_eval(ast.parse(f.read_text(), rel)):
                offenders.append(rel)
    assert offenders == []


def test_moved_modules_are_not_left_behind():
    # eval/data/ (package data) would shadow a missing eval/data.py as an empty namespace package
    assert not (REPO / "eval" / "data.py").exists() and not (REPO / "eval" / "kvtypes.py").exists()
    from rotaryquant import data, kvtypes

    assert callable(data.calibration_text) and callable(data.evaluation_text)
    assert kvtypes.split("q8_0/isoquant3_0+calib") == ("q8_0", "isoquant3_0")
