"""rotaryquant.build.tools: finding and installing Chromium for the web UI's browser test."""

from __future__ import annotations

import shutil

from rotaryquant.build import tools


def test_rq_chromium_names_the_browser(tmp_path, monkeypatch):
    exe = tmp_path / "my-chrome"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("RQ_CHROMIUM", str(exe))
    assert tools.chromium_exe() == str(exe)
    assert tools.ensure_chromium() == str(exe)


def test_no_chromium_and_no_apt_gives_none(monkeypatch, capsys):
    monkeypatch.delenv("RQ_CHROMIUM", raising=False)
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    asked = []
    monkeypatch.setattr(tools, "_apt_install", lambda pkgs: asked.append(pkgs) or False)
    assert tools.ensure_chromium() is None
    assert asked == [["chromium"]]
    assert "installing chromium" in capsys.readouterr().out
