"""The browser tests' fixtures: Debian's Chromium (tests/helpers/browser.py; the tests skip, saying why,
when it cannot be installed), driven by Playwright for Python, never a browser download. `browser` is one
headless Chromium for a module; every test gets a fresh context (`page`: its own storage, cookies,
localStorage) with its console messages and page errors recorded in `page.log`."""

from __future__ import annotations

import pytest

from tests.helpers.browser import CHROMIUM, CHROMIUM_FLAGS, PageLog, ensure_chromium


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for a module's browser tests. Module-scoped, not session-scoped: while
    Playwright's sync API is started, its event loop is the thread's running loop, and any other test's
    asyncio.run() would fail."""
    reason = ensure_chromium()
    if reason is not None:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Playwright gives each launch a fresh temporary user-data directory, removed on close.
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    """A page in a fresh context, 1400x900, its console recorded in `page.log` (a PageLog)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(20_000)
    new_page = context.new_page()
    new_page.log = PageLog()
    new_page.on("console", lambda message: new_page.log.console.append((message.type, message.text)))
    new_page.on("pageerror", lambda error: new_page.log.errors.append(str(error)))
    try:
        yield new_page
    finally:
        context.close()
