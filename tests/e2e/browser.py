"""Headless Chromium for the browser tests and the screenshot script: Debian's `chromium` and
`chromium-driver` packages (`make setup` installs them when missing), driven by Selenium pointed at
them, so nothing is downloaded."""

from __future__ import annotations

import shutil
import time

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    """Why no browser can run here (None: it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            return f"{path} is missing: make setup installs Debian's chromium and chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is missing: pip install -e '.[dev]'"
    return None


def start_browser(width_px: int = 1400, height_px: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={width_px},{height_px}", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def wait_for(condition, timeout_s: float = 30.0, what: str = "the page"):
    """Poll `condition()` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
