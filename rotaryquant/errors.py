"""One error model for every rq-* command: ``RQError(message, fix)`` and the ``run_cli`` wrapper.

A library function that cannot go on raises an ``RQError`` (or a subclass) whose ``str()`` is one
self-contained line: what is wrong, then how to fix it. ``run_cli`` turns that into the exit codes every
command shares: 0 done, 1 an error (``prog: error: ...`` on stderr, no traceback), 2 a usage error
(argparse's own SystemExit(2), or a ``UsageError`` found after parsing), 130 Ctrl-C.

A missing build is an error like any other: the code that locates the build (``bindings.ggml`` for the
libraries, ``bindings.tools`` for the programs) raises ``MissingBuildError``, which names the command that
builds it. Nothing else is translated: an ``OSError`` (a user's missing input file, say) is a bug of the
code that let it through, and shows as one, with its traceback.

Stdlib only: rq-setup imports this before any virtual environment exists.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

SETUP_FIX = "run `make setup` (or `python3 -m rotaryquant.build setup`) to build the patched llama.cpp"


class RQError(Exception):
    """A request that cannot be carried out. ``str(e)`` is one line for the user: the problem; the fix."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(f"{message}; {fix}" if fix else message)


class UsageError(RQError):
    """Options that cannot go together, found after argparse: exit 2, as argparse's own usage errors."""


class PlanError(RQError):
    """A memory plan that cannot be made (rq-plan), or llama.cpp's own accounting under it refusing a model or a
    cache type (``rotaryquant.bindings.accounting``)."""


class MissingBuildError(RQError):
    """A library, program or module of the patched llama.cpp build is not there (or is not ours)."""

    def __init__(self, message: str, fix: str = SETUP_FIX) -> None:
        super().__init__(message, fix)


def run_cli(prog: str, main: Callable[[list[str] | None], int | None], argv: list[str] | None = None, *,
            interrupted: str = "interrupted") -> int:
    """``main(argv)`` with the shared exit codes. argparse's SystemExit (2 on a usage error, 0 for --help)
    passes through unchanged; ``interrupted`` is what Ctrl-C prints after ``prog: ``."""
    try:
        rc = main(argv)
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RQError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR
    return EXIT_OK if rc is None else int(rc)
