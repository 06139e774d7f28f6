"""Headless Chromium for tests, driven over the DevTools protocol (websocket), no browser download.

* `ensure_chromium()`: the path of Debian's `chromium`, installed with apt when missing (root
  only); raises `BrowserUnavailable` with the reason otherwise.
* `Chromium(executable, log_dir=)`: context manager; a headless browser on a free loopback
  port with a throw-away profile, started through `harness.Process` (stopped with the session,
  never leaked). `.open(url)` gives a `Page`: `.evaluate(js)`, `.wait_for(js, timeout)`,
  `.screenshot(path)`, `.close()`.

Only 127.0.0.1 is ever contacted: the DevTools endpoint and the pages a test opens.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests import harness

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
APT_TIMEOUT_S = 600
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio",
         "--no-default-browser-check", "--hide-scrollbars", "--window-size=1280,900")


class BrowserUnavailable(RuntimeError):
    """No headless Chromium can run here; the message says why."""


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def ensure_chromium() -> str:
    """The Chromium executable; installs Debian's `chromium` with apt when missing (as root)."""
    found = find_chromium()
    if found:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise BrowserUnavailable("chromium is not installed and this is not root (apt-get install "
                                 "-y --no-install-recommends chromium)")
    if shutil.which("apt-get") is None:
        raise BrowserUnavailable("chromium is not installed and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]

    def apt(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=env, capture_output=True, text=True, check=False,
                              stdin=subprocess.DEVNULL, timeout=APT_TIMEOUT_S)

    try:
        done = apt(install)
        if done.returncode != 0:  # most often: no package lists yet
            apt(["apt-get", "update"])
            done = apt(install)
    except subprocess.TimeoutExpired:
        raise BrowserUnavailable(f"apt-get install chromium took over {APT_TIMEOUT_S}s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
        raise BrowserUnavailable(f"apt-get install chromium failed (exit {done.returncode}):\n{tail}")
    found = find_chromium()
    if not found:
        raise BrowserUnavailable("chromium was installed but is not on PATH")
    return found


class Page:
    """One tab, over its DevTools websocket."""

    def __init__(self, browser: Chromium, target_id: str, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.browser, self.target_id = browser, target_id
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(connect(ws_url, max_size=64 * 1024 * 1024,
                                                     open_timeout=10))
        self._ids = itertools.count(1)
        self.console: list[str] = []  # console messages and uncaught exceptions
        self.send("Runtime.enable")
        self.send("Page.enable")

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 15) -> dict[str, Any]:
        """Call a DevTools method; returns its result (raises on an error answer)."""
        ident = next(self._ids)
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"DevTools {method} did not answer within {timeout}s")
            message = json.loads(self._ws.recv(timeout=left))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"DevTools {method}: {message['error']}")
                return message.get("result", {})
            self._on_event(message)

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"console.{params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console.append("exception: " + str(details.get("exception", {}).get("description")
                                                    or details.get("text")))

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression (JSON-serialisable; promises awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error in {expression!r}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 10, interval: float = 0.05) -> Any:
        """Evaluate until truthy; returns the value. TimeoutError with the console otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as exc:  # e.g. the context went away while a page (re)loads
                value = exc
            if value and not isinstance(value, RuntimeError):
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{expression!r} still falsy after {timeout}s (last: {value!r}); "
                                   f"console: {self.console[-10:]}")
            time.sleep(interval)

    def screenshot(self, path: str | os.PathLike[str], full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                                "scale": 1})
        data = self.send("Page.captureScreenshot", params)["data"]
        out = Path(path)
        out.write_bytes(base64.b64decode(data))
        return out

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self.browser._close_target(self.target_id)


class Chromium:
    """A headless Chromium with a throw-away profile, reachable on a loopback DevTools port."""

    def __init__(self, executable: str, *, log_dir: str | os.PathLike[str] | None = None,
                 start_timeout: float = 20) -> None:
        self.port = harness.free_port()
        self.profile = tempfile.mkdtemp(prefix="cortex-chromium-")
        self.base = f"http://127.0.0.1:{self.port}"
        args = [executable, *FLAGS, f"--user-data-dir={self.profile}",
                "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={self.port}",
                "about:blank"]
        self.process = harness.Process(args, name="chromium", log_dir=log_dir)
        try:
            harness.wait_until(self._ready, timeout=start_timeout, interval=0.1,
                               message=lambda: f"chromium did not start:\n{self.process.tail(20)}")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if not self.process.alive:
            raise harness.HarnessError(f"chromium exited:\n{self.process.tail(20)}")
        try:
            return httpx.get(f"{self.base}/json/version", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def open(self, url: str, init_script: str | None = None) -> Page:
        """A new tab showing `url`; `init_script` runs in it before the page's own scripts."""
        target = httpx.put(f"{self.base}/json/new?about:blank", timeout=10).json()
        page = Page(self, target["id"], target["webSocketDebuggerUrl"])
        if init_script:
            page.send("Page.addScriptToEvaluateOnNewDocument", {"source": init_script})
        page.navigate(url)
        return page

    def _close_target(self, target_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{self.base}/json/close/{target_id}", timeout=5)

    def stop(self) -> None:
        self.process.stop(timeout=3)  # a throw-away profile: SIGKILL after 3 s is fine
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
