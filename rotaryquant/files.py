"""File helpers shared by set-up (``rotaryquant.build``) and the default assets (``rotaryquant.assets``).

Stdlib only and a leaf: it imports nothing of ours, so either side can use it before the virtual
environment exists.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def publish(tmp: str | Path, dst: str | Path) -> None:
    """Renames a finished temp file onto ``dst`` with the mode a new file gets (0666 less the umask):
    mkstemp makes its files 0600, which a plain rename would hand on to the user's output."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, dst)
