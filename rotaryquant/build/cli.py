"""rq-setup: fetch the pinned llama.cpp, apply ggml-patches/, build it, wire Python to it.

Runs with the system Python (stdlib only) before any virtual environment exists:

    python3 -m rotaryquant.build setup        # everything below, idempotent
    python3 -m rotaryquant.build setup --demo # only what `make demo` runs (the rest later)
    python3 -m rotaryquant.build setup --vulkan   # the same with the Vulkan backend (build/vulkan)
    python3 -m rotaryquant.build build --vulkan --target llama-perplexity   # a build only (no Python wiring)
    python3 -m rotaryquant.build export-patches   # upstream tree edits -> ggml-patches/*.patch
    python3 -m rotaryquant.build wheel        # setup, then dist/*.whl for any Python environment

Every step is skipped when its stamp says it is done; every failure is one line that says
what failed and how to fix it, and leaves nothing half-done that a re-run would trust.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rotaryquant import assets, paths
from rotaryquant.build.cmake import (CUDA_TARGETS, DEMO_TARGETS, TARGETS, VULKAN_TARGETS, configure_and_build,
                                    cuda_cmake_args)
from rotaryquant.build.common import Phases, SetupError, log
from rotaryquant.build.install import install_python
from rotaryquant.build.patches import apply_patches, export_patches
from rotaryquant.build.sdist import Lock, fetch_sdist, read_lock, unpack
from rotaryquant.build.tools import check_tools, ensure_ccache, ensure_vulkan
from rotaryquant.build.ui import ensure_ui
from rotaryquant.build.venv import ensure_python_deps, ensure_venv, venv_python
from rotaryquant.build.wheel import build_wheels
from rotaryquant.errors import run_cli


def _backend(ns: argparse.Namespace) -> tuple[str, list[str], list[str]]:
    """The build folder, CMake arguments and targets of --cuda / --vulkan (or the CPU build)."""
    if ns.cuda and ns.vulkan:
        raise SetupError("--cuda and --vulkan build separate folders: run setup once for each")
    extra = list(ns.cmake_arg or [])
    targets = TARGETS
    flavour = "cpu"
    if ns.cuda:
        extra += ["-DGGML_CUDA=ON", *cuda_cmake_args()]
        targets, flavour = TARGETS + CUDA_TARGETS, "cuda"
    elif ns.vulkan:
        ensure_vulkan()
        extra += ["-DGGML_VULKAN=ON"]
        targets, flavour = TARGETS + VULKAN_TARGETS, "vulkan"
    return ns.flavour or flavour, extra, targets


def _patched_tree(ccache: bool = True, test_deps: bool = True, phase: Phases | None = None) -> Lock:
    """Tools, the venv, and the pinned sdist unpacked and patched (every step skipped when done)."""
    phase = phase or Phases()
    with phase("tools"):
        check_tools()
        if ccache:
            ensure_ccache()
    with phase("venv"):
        ensure_venv()
        ensure_python_deps(test_deps)
    with phase("sdist+patches"):
        lock = read_lock()
        unpack(lock, fetch_sdist(lock))
        apply_patches(lock)
    return lock


def _ui(ns: argparse.Namespace, lock: Lock) -> None:
    """The web UI linked into the tree (or not: --no-ui, no npm, a failed npm build) before building."""
    ensure_ui(lock.llama_cpp_commit or lock.version, skip=ns.no_ui)


def cmd_setup(ns: argparse.Namespace) -> None:
    demo = ns.demo
    phase = Phases()
    lock = _patched_tree(test_deps=not demo, phase=phase)
    if not demo:   # the demo runs no llama-server: its web UI waits for the full set-up
        with phase("web UI"):
            _ui(ns, lock)
    flavour, extra, targets = _backend(ns)
    with phase("build"):
        configure_and_build(flavour, extra, ns.jobs, DEMO_TARGETS if demo else targets)
    with phase("python"):
        install_python(flavour)
    if not ns.no_assets:
        with phase("models+text"):
            assets.ensure_default_assets(python=str(venv_python()))
    log(phase.line())
    log("ready" + (" for the demo (the rest: make test, or setup without --demo)" if demo else ""))


def cmd_build(ns: argparse.Namespace) -> None:
    _ui(ns, _patched_tree())
    flavour, extra, targets = _backend(ns)
    configure_and_build(flavour, extra, ns.jobs, ns.target or targets)
    log(f"built {paths.bin_dir(flavour)}")


def cmd_patch(ns: argparse.Namespace) -> None:
    _patched_tree(ccache=False)
    log(f"patched tree: {paths.src_root()}")


def cmd_export(ns: argparse.Namespace) -> None:
    export_patches()


def cmd_wheel(ns: argparse.Namespace) -> None:
    cmd_setup(ns)
    build_wheels(_backend(ns)[0], Path(ns.out) if ns.out else None)


def _main(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(prog="rq-setup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="venv, fetch, patch, build, install (idempotent)")
    w = sub.add_parser("wheel", help="setup, then wheels of the patched llama-cpp-python (our libraries and "
                                     "llama.cpp's tools inside), the patched gguf and rotaryquant, for "
                                     "`pip install dist/*.whl` in any environment")
    b = sub.add_parser("build", help="fetch, patch and build one folder, without the venv or Python wiring "
                                     "(the CI jobs; setup does this and more)")
    for x in (s, b, w):
        x.add_argument("--cuda", action="store_true", help="also build the CUDA backend (-DGGML_CUDA=ON; build/cuda)")
        x.add_argument("--vulkan", action="store_true",
                       help="also build the Vulkan backend (-DGGML_VULKAN=ON; build/vulkan); installs glslc, the "
                            "Vulkan headers and Mesa's lavapipe with apt-get when missing (as root)")
        x.add_argument("--flavour", help="build folder name under build/ (default: cpu, cuda or vulkan)")
        x.add_argument("--cmake-arg", action="append", help="extra CMake argument (repeatable)")
        x.add_argument("-j", "--jobs", type=int, help="parallel build jobs (default: all cores)")
        x.add_argument("--no-ui", action="store_true",
                       help="build llama-server without its web UI (skips npm; also RQ_NO_UI=1)")
    for x in (s, w):
        x.add_argument("--no-assets", action="store_true", help="skip the default model and text")
    s.add_argument("--demo", action="store_true",
                   help="only what `make demo` runs (the libraries and llama-imatrix; no web UI, no test dependencies): "
                        "a fresh machine's first minutes; a later setup without it builds the rest")
    s.set_defaults(fn=cmd_setup)
    w.add_argument("--out", help="folder for the wheels (default: dist/)")
    w.set_defaults(fn=cmd_wheel, demo=False)
    b.add_argument("--target", action="append", help="build only this target (repeatable; default: all of setup's)")
    b.set_defaults(fn=cmd_build)
    p = sub.add_parser("patch", help="fetch the sdist and apply ggml-patches/ (no build)")
    p.set_defaults(fn=cmd_patch)
    e = sub.add_parser("export-patches", help="write the upstream tree's commits since `pristine` "
                                              "back to ggml-patches/*.patch")
    e.set_defaults(fn=cmd_export)
    ns = ap.parse_args(argv)
    ns.fn(ns)


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-setup", _main, argv)
