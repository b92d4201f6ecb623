"""What every rq-eval subcommand shares: results written whole (temp file, then rename), comma lists parsed with
errors that name the option, the --model default."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rotaryquant import assets, paths
from rotaryquant.errors import RQError

RESULTS = paths.REPO / "docs" / "results"


def result_file(stem: Path, suffix: str) -> Path:
    """STEM.json for -o STEM: a stem with a dot of its own (needles-d0.5) keeps it; a .json or .md given is the
    stem's own suffix and is replaced."""
    return stem.with_suffix(suffix) if stem.suffix in (".json", ".md") else stem.with_name(stem.name + suffix)


def write(stem: Path, res: dict | list, md: str, *, echo: bool = True) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(res, indent=1)), (".md", md)):
        tmp = result_file(stem, suffix + ".partial")
        tmp.write_text(text)
        tmp.replace(result_file(stem, suffix))
    if echo:
        print(md)


def ints(spec: str, what: str) -> list[int]:
    try:
        return [int(x) for x in names(spec)]
    except ValueError:
        raise RQError(f"{what} takes comma-separated integers, got {spec!r}") from None


def floats(spec: str, what: str) -> list[float]:
    try:
        return [float(x) for x in names(spec)]
    except ValueError:
        raise RQError(f"{what} takes comma-separated numbers, got {spec!r}") from None


def names(spec: str) -> list[str]:
    return [x.strip() for x in spec.split(",") if x.strip()]


def model_path(ns: argparse.Namespace, default: str) -> Path:
    model = ns.model or assets.model_path(default)
    if not Path(model).exists():
        raise RQError(f"model {model} does not exist")
    return Path(model)
