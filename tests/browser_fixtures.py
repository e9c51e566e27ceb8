"""Headless Chromium for every browser test (portal and console): Debian's
binary driven by Playwright (never a downloaded browser), one browser per test
session, and screenshots under artifacts/screenshots/ (git-ignored).

Registered for the whole suite in tests/conftest.py: Playwright's sync API
allows one instance per thread, so the browser must be a single fixture."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("GPUSHARE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parent.parent.parent / "artifacts" / "screenshots"


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        raise RuntimeError(f"Chromium not found at {CHROMIUM}: apt-get install -y chromium (.ci/run does it)")
    # Playwright's sync API runs an event loop in this thread; the tests' own ORM
    # calls (creating users, reading results) are still plain synchronous code.
    # Django checks this variable at each call: set only while a browser is up.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def screenshot():
    """``screenshot(page, "name")`` saves artifacts/screenshots/name.png (full page)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(page, name: str) -> Path:
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take
