"""The system tools set-up needs: git and a C/C++ compiler, ccache (installed when root and apt-get
allow), and CMake >= 3.21 (the system's, or the one pip puts in the venv)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from rotaryquant import paths
from rotaryquant.build.common import SetupError, log


def check_tools() -> None:
    missing = [t for t in ("git", "cc", "c++") if shutil.which(t) is None]
    if missing:
        raise SetupError(f"missing tools: {', '.join(missing)}; install them "
                         "(Debian: apt-get install build-essential git)")


def ensure_ccache() -> None:
    if shutil.which("ccache"):
        return
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        log("installing ccache (apt-get)")
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "ccache"], capture_output=True)
        if proc.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            proc = subprocess.run(["apt-get", "install", "-y", "-q", "ccache"], capture_output=True)
        if proc.returncode == 0:
            return
    log("note: ccache not available; builds will not be cached (apt-get install ccache)")


def cmake_ok(exe: str | None) -> bool:
    if not exe:
        return False
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    m = re.search(r"(\d+)\.(\d+)", out)
    return bool(m) and (int(m[1]), int(m[2])) >= (3, 21)


def cmake_exe() -> str:
    venv_cmake = paths.venv_dir() / "bin" / "cmake"
    if venv_cmake.exists():
        return str(venv_cmake)
    exe = shutil.which("cmake")
    if not cmake_ok(exe):
        raise SetupError("CMake >= 3.21 not found; install it (apt-get install cmake, or pip install cmake)")
    return exe  # type: ignore[return-value]
