"""The converter's one exception type: a message that names the input and says how to fix it."""

from __future__ import annotations

from rotaryquant.errors import RQError


class ConvertError(RQError):
    """A conversion that cannot go on. ``str(e)`` is one self-contained line for the user.

    The CLI prints it as ``rq-convert: error: <message>`` and exits 1; no output file is left behind.
    """
