"""Headless Chromium for tests that drive a page: Debian's `chromium` + `chromium-driver` through selenium.
`chromium_or_skip()` gives the reason a test skips where any of them is missing (`make install` installs them as
root with apt)."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def chromium_or_skip():
    """A started headless Chromium (selenium WebDriver), or a skip naming what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium; it is in the test extra)")
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("chromium or chromedriver missing (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-extensions", "--no-first-run", "--window-size=1280,900", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console messages: CSP violations show there
    # An explicit driver path: selenium never tries to download one (no network here).
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def console_errors(driver) -> list[str]:
    """Console messages at SEVERE since the last call (a CSP violation, an exception in a script)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
