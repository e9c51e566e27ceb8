"""Headless Chromium for the browser tests: Debian's binary driven by Playwright
(never a downloaded browser), a logged-in page per user, screenshots under
artifacts/screenshots/ (git-ignored) for a reviewer to look at."""

from __future__ import annotations

import pytest

# Redoc (/api/docs/) shows a logo from its CDN and hides it when it cannot load: the policy
# blocks it on purpose (the docs ask no third party). The one report a page may raise.
CSP_EXPECTED = ("https://cdn.redoc.ly/",)


@pytest.fixture
def page_for(browser, live_server):
    """``page_for(user, password=..., viewport=...)`` -> a Playwright page logged in as ``user``
    (``user=None``: a visitor who is not logged in).

    Logs in through the login form when the accounts app serves one; otherwise
    (before it exists) puts a real session cookie for the user in the browser.
    """
    contexts = []
    violations: list[str] = []  # every page is held to the content security policy (test_csp.py)

    def make(user, *, password: str | None = None, viewport=(1280, 900)):
        context = browser.new_context(base_url=live_server.url, viewport={"width": viewport[0], "height": viewport[1]})
        context.set_default_timeout(30_000)
        contexts.append(context)
        page = context.new_page()
        page.on("console", lambda msg: msg.type == "error" and print("browser console:", msg.text))
        page.on(
            "console",
            lambda msg: (
                "Content Security Policy" in msg.text
                and not any(url in msg.text for url in CSP_EXPECTED)
                and violations.append(msg.text)
            ),
        )
        if user is not None and not _form_login(page, user, password):
            _cookie_login(context, user, live_server.url)
        return page

    yield make
    for context in contexts:
        context.close()
    assert not violations, f"content security policy violations: {violations}"


def _form_login(page, user, password) -> bool:
    if password is None:
        return False
    response = page.goto("/accounts/login/")
    if response is None or response.status != 200 or page.locator("input[name=password]").count() == 0:
        return False
    page.fill("input[name=username]", user.username)
    page.fill("input[name=password]", password)
    page.locator("form:has(input[name=password]) [type=submit]").click()
    page.wait_for_load_state()
    return "/accounts/login/" not in page.url


def _cookie_login(context, user, url: str) -> None:
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME]
    context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": cookie.value, "url": url}])
