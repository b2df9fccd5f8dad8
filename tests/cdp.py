"""A small client for Chromium's DevTools protocol: one page, commands and events."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """Headless chromium on a private profile; ``page`` talks to its first tab."""

    def __init__(self, binary: str, profile: Path, log: Path) -> None:
        self.log = log.open("wb")
        port_file = profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a reused profile's is stale
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={profile}",
             "--window-size=1440,1000", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                "chromium did not start"
            )
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            targets = json.loads(reply.read())
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        self.exits = contextlib.ExitStack()
        self.page = Page(self.exits.enter_context(connect(url, max_size=64 << 20, open_timeout=20)))

    def close(self) -> None:
        self.exits.close()
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class CdpError(AssertionError):
    """The browser answered a command with an error."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error)
        self.message = str(error.get("message", ""))

    @property
    def navigated(self) -> bool:
        """The page the command ran in was replaced (a form submitted, a link followed)."""
        return "navigated or closed" in self.message or "context was destroyed" in self.message


class Page:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        self.dialogs: list[str] = []  # confirm()/alert() messages, each accepted as an OK

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        wanted = self._post(method, **params)
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == wanted:
                if "error" in message:
                    raise CdpError(message["error"])
                return message.get("result", {})
            if message.get("method") == "Page.javascriptDialogOpening":
                # the page waits on the dialog (and a click that opened it on the page):
                # press OK, as the person clicking would (needs Page.enable)
                self.dialogs.append(message["params"]["message"])
                self._post("Page.handleJavaScriptDialog", accept=True)
            self.events.append(message)

    def _post(self, method: str, **params: Any) -> int:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        return self.next_id

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)  # fmt: skip
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Polls ``expression`` until it is truthy; an evaluation the page's own navigation
        cut short (a form it submitted, a reload) counts as not yet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except CdpError as exc:
                if not exc.navigated:
                    raise
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)

    def click(self, selector: str, hold_s: float = 0.1) -> None:
        """Click the element as a person does: the mouse moves onto its middle, presses,
        holds ``hold_s`` and lets go (real input events, not ``element.click()``)."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return {x: r.left + r.width / 2, y: r.top + r.height / 2}; })()"
        )
        x, y = box["x"], box["y"]
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        self.send("Input.dispatchMouseEvent", type="mousePressed", x=x, y=y, button="left",
                  buttons=1, clickCount=1)  # fmt: skip
        time.sleep(hold_s)
        self.send("Input.dispatchMouseEvent", type="mouseReleased", x=x, y=y, button="left",
                  buttons=0, clickCount=1)  # fmt: skip

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and error log entries so far."""
        self.evaluate("1")  # collect the events that arrived meanwhile
        out = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                out.append(json.dumps(params["args"])[:500])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                out.append(f"{params['entry'].get('url')}: {params['entry']['text']}")
        return out
