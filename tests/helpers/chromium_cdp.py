"""Headless Chromium driven over the DevTools protocol (CDP, one websocket): enough to load a page, type
into it as a user does (focus, insert text, Enter), read the DOM and take a screenshot. The web UI test
uses it against llama-server; Chromium is Debian's (``rotaryquant.build.tools.ensure_chromium``).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import websocket  # websocket-client (pyproject's test extras)


class BrowserError(RuntimeError):
    pass


class Page:
    """One tab: CDP commands by name, with their results; events are read past and dropped."""

    def __init__(self, ws_url: str, timeout: float = 60) -> None:
        self._ws = websocket.create_connection(ws_url, timeout=timeout, suppress_origin=True)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._ws.close()

    def send(self, method: str, **params: Any) -> dict:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") != msg_id:
                continue
            if "error" in msg:
                raise BrowserError(f"{method}: {msg['error'].get('message', msg['error'])}")
            return msg.get("result", {})

    def evaluate(self, expr: str) -> Any:
        """The value of a JavaScript expression (promises awaited); page exceptions raise BrowserError."""
        r = self.send("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            detail = r["exceptionDetails"]
            raise BrowserError(f"{expr[:60]}: {detail.get('exception', {}).get('description', detail.get('text'))}")
        return r.get("result", {}).get("value")

    def goto(self, url: str, ready: str = "document.readyState === 'complete'", timeout: float = 60) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for(ready, timeout, f"{url} did not load")

    def wait_for(self, expr: str, timeout: float, what: str, poll: float = 0.25) -> Any:
        """Poll a JavaScript expression until it is truthy; its value, or BrowserError after timeout."""
        deadline = time.time() + timeout
        while True:
            value = self.evaluate(expr)
            if value:
                return value
            if time.time() > deadline:
                raise BrowserError(f"{what} within {timeout:.0f} s ({expr[:80]})")
            time.sleep(poll)

    def type_text(self, selector: str, text: str) -> None:
        """Focus the element and type text into it the way a keyboard does (input events, not .value)."""
        found = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                              "if (!e) return false; e.focus(); return document.activeElement === e; })()")
        if not found:
            raise BrowserError(f"no focusable element {selector!r}")
        self.send("Input.insertText", text=text)

    def press_enter(self) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13}
        self.send("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
        self.send("Input.dispatchKeyEvent", type="keyUp", **key)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


def _wait(what: str, timeout: float, probe: Callable[[], Any]) -> Any:
    deadline = time.time() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.time() > deadline:
            raise BrowserError(f"{what} within {timeout:.0f} s")
        time.sleep(0.1)


def _devtools_port(profile: Path, proc: subprocess.Popen) -> int | None:
    if proc.poll() is not None:
        raise BrowserError(f"chromium exited with {proc.returncode}")
    f = profile / "DevToolsActivePort"
    try:
        return int(f.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # children that outlived the browser process
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def chromium(exe: str, width: int = 1280, height: int = 900, start_timeout: float = 60) -> Iterator[Page]:
    """A headless Chromium with a fresh profile on a free DevTools port; yields its first tab and stops the
    browser (and removes the profile) on exit."""
    profile = Path(tempfile.mkdtemp(prefix="rq-chromium-"))
    # --no-sandbox: the suite runs as root, which Chromium's sandbox refuses
    cmd = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
           f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
           f"--window-size={width},{height}", "about:blank"]
    log = (profile.parent / (profile.name + ".log")).open("w+")
    # its own process group: the renderer, GPU and zygote children go with it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    page: Page | None = None
    try:
        try:
            port = _wait("chromium's DevTools port", start_timeout, lambda: _devtools_port(profile, proc))
        except BrowserError as e:
            log.seek(0)
            raise BrowserError(f"{e}: {log.read()[-1500:]}") from None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = json.loads(r.read())
        tab = next(t for t in targets if t.get("type") == "page")
        page = Page(tab["webSocketDebuggerUrl"])
        page.send("Page.enable")
        page.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        yield page
    finally:
        if page is not None:
            page.close()
        _stop_group(proc)
        log.close()
        Path(log.name).unlink(missing_ok=True)
        shutil.rmtree(profile, ignore_errors=True)
