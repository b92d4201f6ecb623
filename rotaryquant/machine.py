"""What machine a measurement ran on (results files record it next to the numbers)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "arch": platform.machine(), "python": platform.python_version()}
