"""rotaryquant.build.ui: the web UI built with npm into the cache, keyed by its source, linked as tools/ui/dist;
a UI-less build (never a failed set-up) without npm or when npm fails; and the real build embeds it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rotaryquant import paths
from rotaryquant.build import ui

# a stand-in for npm: `ci` and `run build` are logged to $FAKE_NPM_LOG; FAKE_NPM_FAIL=ci|build fails that step;
# `run build` writes index.html into $LLAMA_UI_OUT_DIR as the real build does
FAKE_NPM = """#!/bin/sh
echo "$*" >> "$FAKE_NPM_LOG"
case "$1" in
  ci) [ "$FAKE_NPM_FAIL" = ci ] && { echo "npm ERR! network" >&2; exit 1; }; mkdir -p node_modules ;;
  run) [ "$FAKE_NPM_FAIL" = build ] && exit 2
       mkdir -p "$LLAMA_UI_OUT_DIR" && echo "<html>$LLAMA_BUILD_NUMBER</html>" > "$LLAMA_UI_OUT_DIR/index.html" ;;
esac
"""


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


@pytest.fixture()
def tree(tmp_path, monkeypatch) -> Path:
    """A tiny upstream tree (a git repo, as set-up makes) with a UI source folder, and its own cache."""
    monkeypatch.setenv("RQ_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("RQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ui.NO_UI_ENV, raising=False)
    root = paths.src_root()
    src = root / ui.UI_REL
    (src / "src").mkdir(parents=True)
    (src / "package.json").write_text('{"name": "llama-ui"}\n')
    (src / "package-lock.json").write_text('{"lockfileVersion": 3}\n')
    (src / "src" / "app.ts").write_text("export const x = 1;\n")
    (src / ".gitignore").write_text("node_modules\ndist\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "pristine")
    return src


@pytest.fixture()
def fake_npm(tmp_path, monkeypatch) -> Path:
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "npm").write_text(FAKE_NPM)
    (bindir / "node").write_text("#!/bin/sh\necho v20.20.2\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "npm-calls.log"
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_source_files_are_the_tracked_and_untracked_sources_without_outputs(tree):
    (tree / "node_modules").mkdir()
    (tree / "node_modules" / "dep.js").write_text("x")
    (tree / "dist").mkdir()
    (tree / "dist" / "index.html").write_text("x")
    (tree / "src" / "new.ts").write_text("y")  # not committed yet: still the UI's source
    assert ui.source_files(paths.src_root()) == [".gitignore", "package-lock.json", "package.json",
                                                  "src/app.ts", "src/new.ts"]


def test_key_follows_the_lockfile_the_source_and_the_label(tree):
    files = ui.source_files(paths.src_root())
    key = ui.source_key(tree, files, "node20|abc")
    assert len(key) == 16 and key == ui.source_key(tree, files, "node20|abc")
    assert ui.source_key(tree, files, "node22|abc") != key
    (tree / "package-lock.json").write_text('{"lockfileVersion": 3, "x": 1}\n')
    assert ui.source_key(tree, files, "node20|abc") != key


def test_build_is_cached_linked_and_a_second_setup_is_a_no_op(tree, fake_npm, capsys):
    assert ui.ensure_ui("0c1e570")
    assert fake_npm.read_text().splitlines() == ["ci", "run build"]
    link = ui.dist_link()
    assert link.is_symlink() and link.resolve().parent.parent == ui.ui_cache().resolve()
    assert (link / "index.html").read_text() == "<html>0c1e570</html>\n"  # the label reaches the build
    # node_modules does not stay in the cache, nor the staging folder
    assert not list(ui.ui_cache().glob("*/src")) and not list(ui.ui_cache().glob("*.tmp"))
    first = link.resolve()
    assert ui.ensure_ui("0c1e570")
    assert fake_npm.read_text().splitlines() == ["ci", "run build"], "second set-up ran npm again"
    # an edited source is a new key: rebuilt, relinked (the old build stays for other clones)
    (tree / "src" / "app.ts").write_text("export const x = 2;\n")
    assert ui.ensure_ui("0c1e570")
    assert fake_npm.read_text().splitlines().count("ci") == 2
    assert link.resolve() != first and first.exists()
    assert "UI: built in" in capsys.readouterr().out


@pytest.mark.parametrize("step", ["ci", "build"])
def test_failed_npm_gives_a_ui_less_build_and_one_line(tree, fake_npm, monkeypatch, capsys, step):
    monkeypatch.setenv("FAKE_NPM_FAIL", step)
    ui.dist_link().symlink_to(tree / "stale")  # an old link does not survive a failed build
    assert not ui.ensure_ui("0c1e570")
    assert not ui.dist_link().is_symlink() and not ui.dist_link().exists()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "without the web UI" in ln]
    assert len(lines) == 1 and "failed (exit" in lines[0] and "npm.log" in lines[0]
    assert not list(ui.ui_cache().glob("*.tmp"))


def test_no_npm_gives_a_ui_less_build_and_says_how_to_get_one(tree, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    assert not ui.ensure_ui("0c1e570")
    out = capsys.readouterr().out
    assert "npm/node not found" in out and "re-run set-up" in out
    assert not ui.dist_link().exists()


def test_skip_switches(tree, fake_npm, monkeypatch, capsys):
    assert not ui.ensure_ui("x", skip=True)
    monkeypatch.setenv(ui.NO_UI_ENV, "1")
    assert not ui.ensure_ui("x")
    assert not fake_npm.exists()
    assert capsys.readouterr().out.count("UI: skipped") == 2


def test_the_built_server_embeds_the_ui():
    # set-up's build (build/cpu) embeds the assets ui.py built; without npm set-up builds no UI, by design
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: set-up builds llama-server without the web UI")
    if os.environ.get(ui.NO_UI_ENV, "") not in ("", "0"):
        pytest.skip("RQ_NO_UI is set: set-up built llama-server without the web UI")
    assert (ui.dist_link() / "index.html").exists(), "set-up did not link the web UI into the tree"
    header = paths.cmake_build_dir("cpu") / "llama.cpp" / "tools" / "ui" / "ui.h"
    assert "#define LLAMA_UI_HAS_ASSETS 1" in header.read_text()
