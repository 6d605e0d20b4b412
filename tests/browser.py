"""Headless Chromium for the status page's test and benchmark: Debian's ``chromium`` and
``chromium-driver`` (scripts/bootstrap installs them), driven by Selenium without its manager
downloading anything."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def missing() -> str | None:
    """Why Chromium cannot be driven here (a skip reason), or None."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return "Debian's chromium and chromium-driver are not installed (scripts/bootstrap installs them)"
    return None


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium at 1400 x 900, quit at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    if (why := missing()) is not None:
        raise RuntimeError(why)
    opts = Options()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()
