"""The live /dashboard in headless Chromium (Debian's, driven by Playwright), for the dashboard
tests of one server and of a fleet."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("TOLLWAY_ARTIFACTS", ROOT / "test-artifacts"))


@contextmanager
def dashboard_page(server_url: str, key: str | None = None):
    """The page, live (its first poll answered), and the problems it met as lists: console
    errors and warnings, requests anywhere but `server_url`, responses of 400 and up. Skips
    without Chromium, unless CI requires it."""
    chromium = shutil.which("chromium")
    if chromium is None:
        assert not os.environ.get("TOLLWAY_REQUIRE_BROWSER"), "chromium is missing, and CI requires the browser check"
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems = {"errors": [], "elsewhere": [], "failed": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        view = browser.new_page(viewport={"width": 1440, "height": 1000})
        view.on("console", lambda m: m.type in ("error", "warning") and problems["errors"].append(m.text))
        view.on("pageerror", lambda e: problems["errors"].append(str(e)))
        view.on("request", lambda r: r.url.startswith(server_url + "/") or problems["elsewhere"].append(r.url))
        view.on("response", lambda r: r.status >= 400 and problems["failed"].append(f"{r.status} {r.url}"))
        view.goto(f"{server_url}/dashboard" + (f"?key={key}" if key else ""))
        # A selector, not wait_for_function: Playwright evaluates a string predicate with eval,
        # which the dashboard's Content-Security-Policy (rightly) refuses.
        view.wait_for_selector(".dot.live", state="attached", timeout=10_000)
        yield view, problems
        browser.close()


def shown_values(view) -> dict[str, str]:
    """Every live figure on the page, by its name (data-value)."""
    return view.eval_on_selector_all("[data-value]", "els => Object.fromEntries(els.map(e => [e.dataset.value, "
                                                     "e.textContent]))")
