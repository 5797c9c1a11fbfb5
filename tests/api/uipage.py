"""A browser tab on the /ui playground, for tests/api/test_ui.py (Playwright, sync API).

Waits poll JS expressions from Python: Playwright's wait_for_function evaluates strings
with eval, which the page's Content-Security-Policy forbids (as it should).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.api.conftest import ROOT

OUT = ROOT / "out" / "ui"
CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium's own connections are refused here.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_final(url: str, vid: str, key: str, timeout: float = 180) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = httpx.get(f"{url}/v1/videos/{vid}", headers=auth(key), timeout=10).json()
        if v["status"] not in ("queued", "in_progress"):
            return v
        time.sleep(0.2)
    raise AssertionError(f"{vid} not final after {timeout}s")


class Page:
    """One browser tab on /ui with its own session storage; records JS errors and dialogs."""

    def __init__(self, browser: Any, url: str, width: int = 1440, key: str | None = None,
                 bypass_csp: bool = False, hold: str | None = None) -> None:
        self.ctx = browser.new_context(viewport={"width": width, "height": 900}, bypass_csp=bypass_csp)
        self.held: list[Any] = []  # requests to ``hold`` sent without a key, kept until the test lets them go
        if hold:
            self.ctx.route(hold, lambda route: route.continue_() if route.request.headers.get("authorization")
                           else self.held.append(route))
        self.page = self.ctx.new_page()
        self.width, self.url = width, url
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.goto(f"{url}/ui")
        self.until("document.querySelector('#hint-width').textContent.includes('px')")
        if key is not None:
            self.use_key(key)

    def js(self, expr: str) -> Any:
        return self.page.evaluate(expr)

    def until(self, expr: str, timeout: float = 60) -> Any:
        """Poll a JS expression from here (wait_for_function would need eval, which the CSP forbids)."""
        end = time.monotonic() + timeout
        while True:
            value = self.page.evaluate(expr)
            if value:
                return value
            assert time.monotonic() < end, f"not true after {timeout}s: {expr}"
            time.sleep(0.05)

    def text(self, selector: str) -> str:
        return self.page.locator(selector).text_content() or ""

    def use_key(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.click("#key-use")

    def fill(self, **fields: Any) -> None:
        for name, value in fields.items():
            self.page.fill(f"#f-{name}", str(value))

    def submit(self, **fields: Any) -> str:
        """Fill, click Generate, and return the id the page opened."""
        before = self.current_id()
        self.fill(**fields)
        self.page.click("#submit")
        try:
            return self.until(f"(() => {{ const id = document.getElementById('job-view').dataset.id;"
                              f" return id && id !== {before!r} ? id : null; }})()")
        except AssertionError as e:  # say what the page said instead
            said = self.js("[...document.querySelectorAll('#create-form .err, #create-msg, #key-msg')]"
                           ".filter(n => n.textContent).map(n => `${n.id}: ${n.textContent}`)")
            raise AssertionError(f"{e}; the page said {said}; JS errors {self.errors}") from None

    def current_id(self) -> str:
        """The id of the video the page has open ('' for none)."""
        return self.js("document.getElementById('job-view').dataset.id ?? ''")

    def wait_completed(self, timeout: float = 180) -> None:
        self.until("document.querySelector('#job-status').textContent === 'completed'"
                   " && !document.querySelector('#job-video').hidden", timeout)

    def shot(self, name: str) -> Path:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"{name}-{self.width}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.ctx.close()
        assert not self.errors, self.errors
