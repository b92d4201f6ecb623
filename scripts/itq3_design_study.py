#!/usr/bin/env python3
"""ITQ3_S design study (numpy only): prints every table of docs/itq3-design.md §2 as markdown.

Usage:  python3 scripts/itq3_design_study.py > results.md   (~1 min, 1 core)

The code is the package scripts/itq3_study/ (its docstring describes the study, the real weights
and the bit-exactness conventions); this file is its command line and keeps the names that
docs/itq3-design.md §6 loads from it.
"""
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (docs/itq3-design.md §6)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from itq3_study.data import load_real, rel_rmse, synth_data  # noqa: E402, F401  (used by docs/itq3-design.md §6)
from itq3_study.study import main  # noqa: E402

if __name__ == "__main__":
    main()
