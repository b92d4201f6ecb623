"""`python3 scripts/itq3_study > results.md` (or `python3 -m itq3_study` from scripts/): the design study."""
import sys
from pathlib import Path

if not __package__:  # run as a folder: import the package from scripts/, not its modules from sys.path[0]
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from itq3_study.study import main  # noqa: E402

main()
