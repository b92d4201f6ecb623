"""The converter's one exception type: a message that names the input and says how to fix it."""

from __future__ import annotations


class ConvertError(Exception):
    """A conversion that cannot go on. ``str(e)`` is one self-contained line for the user.

    The CLI prints it as ``rq-convert: error: <message>`` and exits 1; no output file is left behind.
    """

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if not fix else f"{message}; {fix}")
