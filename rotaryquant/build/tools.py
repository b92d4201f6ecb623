"""The system tools set-up needs: git and a C/C++ compiler, ccache (installed when root and apt-get
allow), CMake >= 3.21 (the system's, or the one pip puts in the venv), for --vulkan the Vulkan headers,
loader, glslc and Mesa's drivers (lavapipe: a Vulkan device on the CPU), and for the browser test Debian's
Chromium."""

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


def _apt_install(pkgs: list[str]) -> bool:
    """apt-get install as root (an `apt-get update` first only when the plain install fails)."""
    if not (shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0):
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs]
    if subprocess.run(cmd, capture_output=True, env=env).returncode == 0:
        return True
    subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
    return subprocess.run(cmd, capture_output=True, env=env).returncode == 0


def ensure_ccache() -> None:
    if shutil.which("ccache"):
        return
    log("installing ccache (apt-get)")
    if not _apt_install(["ccache"]):
        log("note: ccache not available; builds will not be cached (apt-get install ccache)")


VULKAN_PACKAGES = ["libvulkan-dev", "glslc", "spirv-headers", "mesa-vulkan-drivers", "vulkan-tools"]


def ensure_vulkan() -> None:
    """glslc, the Vulkan headers and loader (and lavapipe, so that the tests have a device)."""
    have = shutil.which("glslc") and os.path.exists("/usr/include/vulkan/vulkan.hpp")
    if have:
        return
    log(f"installing the Vulkan build tools ({' '.join(VULKAN_PACKAGES)}; apt-get)")
    if not _apt_install(VULKAN_PACKAGES):
        raise SetupError("--vulkan needs glslc and the Vulkan headers and loader; install them "
                         f"(Debian/Ubuntu, as root: apt-get install {' '.join(VULKAN_PACKAGES)})")


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_exe() -> str | None:
    """A Chromium or Chrome on PATH (RQ_CHROMIUM overrides), or None."""
    override = os.environ.get("RQ_CHROMIUM")
    if override:
        return shutil.which(override)
    return next((exe for exe in map(shutil.which, CHROMIUM_NAMES) if exe), None)


def ensure_chromium() -> str | None:
    """Chromium for the web UI's browser test, driven headless over CDP: installed from Debian's
    `chromium` package when missing (apt-get, as root); None when that is not possible."""
    exe = chromium_exe()
    if exe:
        return exe
    log("installing chromium (apt-get) for the browser test")
    if not _apt_install(["chromium"]):
        return None
    return chromium_exe()


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
