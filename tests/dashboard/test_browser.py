"""End to end in a real browser: Debian's chromium, driven by Playwright, against prefixgate + sim ranks.

Chromium comes from ``tests/dashboard/install_browser.sh`` (apt-get), never from Playwright's download.
Without it the test fails in CI (``CI=true``) and skips locally, loudly either way.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from proxy.config import DEFAULT_TARGET_FRACTION
from tests.dashboard.conftest import SYSTEM, converse

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Waits go through Playwright's locator assertions: ``page.wait_for_function`` polls by evaluating a
# string in the page, which the dashboard's CSP (no 'unsafe-eval') refuses whenever the condition is
# not already true on its first check, i.e. on a slow machine.
WAIT_MS = 15_000
AT_LEAST_3 = re.compile(r"^([3-9]|[1-9][0-9]+)$")
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"
TOKEN = "dashboard-admin-token"


#: What installs each part the test needs: the script only runs apt-get (chromium); the Python
#: package comes with the test extra.
INSTALL_CHROMIUM = "bash tests/dashboard/install_browser.sh (Debian's chromium, with apt-get)"
INSTALL_PLAYWRIGHT = "pip install -e '.[test]' (the test extra has playwright; no browser download)"


def _browser_missing(reason: str, remedy: str) -> None:
    message = (
        f"\n{'!' * 78}\n!!! DASHBOARD BROWSER TEST NOT RUN: {reason}\n"
        f"!!! install it with: {remedy}\n"
        f"{'!' * 78}\n"
    )
    print(message, file=sys.stderr)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _playwright():
    """Playwright's ``sync_playwright``, once Debian's chromium and the package are there (else the
    test fails in CI and skips locally, saying why)."""
    if not Path(CHROMIUM).exists():
        _browser_missing(f"{CHROMIUM} is not installed", INSTALL_CHROMIUM)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _browser_missing("the python package 'playwright' is not installed", INSTALL_PLAYWRIGHT)
    return sync_playwright


def _traffic(url: str, headers: dict[str, str]) -> None:
    """Three sessions, one of them breaking its prefix by editing its system prompt at turn 3."""
    converse(url, "agent-alpha", 5, headers)
    time.sleep(0.3)  # a few sample intervals apart: the hit-rate series gets several points
    converse(url, "agent-beta", 4, headers, system="You review pull requests. " * 40)
    time.sleep(0.3)
    converse(url, "agent-gamma", 3, headers)
    edited = SYSTEM.replace("edit files", "edit and test files", 1)
    converse(url, "agent-gamma", 5, headers, system=edited)
    time.sleep(0.3)


def test_dashboard_in_chromium(deployment):
    sync_playwright = _playwright()
    from playwright.sync_api import expect  # after _playwright(): it skips or fails without the package

    dep = deployment(2, admin_token=TOKEN)
    dep.gateway.dashboard.recorder.series.interval = 0.1
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(dep.url + "/dashboard", trust_env=False).status_code == 401
    assert httpx.get(dep.url + "/admin/overview", trust_env=False).status_code == 401
    _traffic(dep.url, {})

    requests: list[str] = []
    errors: list[str] = []
    OUTPUT.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=30_000)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000}, extra_http_headers=auth)
            page = context.new_page()
            page.set_default_timeout(15_000)
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(dep.url + "/dashboard")

            # the hit-rate chart has points, and the figures are filled
            expect(page.locator("#hitchart")).to_have_attribute("data-points", AT_LEAST_3, timeout=WAIT_MS)
            assert page.inner_text("#kpi-window").endswith("%")
            assert page.inner_text("#kpi-sessions") == "3"
            assert page.locator("#ranks .rank").count() == 2

            # a session row appears and opens its turn-by-turn detail
            row = page.locator('tr.session-row[data-key="agent-gamma"]')
            row.wait_for()
            assert "system_edited" in row.inner_text()
            row.click()
            page.wait_for_selector('#session-detail[data-key="agent-gamma"]:not([hidden])')
            assert page.locator("#detail-turns .turn").count() == 8
            assert page.locator("#detail-turns .turn.break").count() >= 1
            assert "system_edited" in page.inner_text("#detail-breaks")
            # the page keeps polling: new traffic shows up without a reload
            converse(dep.url, "agent-delta", 2)
            page.wait_for_selector('tr.session-row[data-key="agent-delta"]')
            page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)
        finally:
            browser.close()

    assert not errors, errors
    # nothing but prefixgate itself was asked for anything
    assert requests and all(u.startswith(dep.url + "/") for u in requests), requests


def _launch(pw):
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=30_000)


def test_dashboard_for_an_operator_in_chromium(deployment):
    """Issue 21: a login page instead of a JSON 401, latency, rate, errors, 429s and the settings, the
    drill-down under the row clicked, a DOWN rank's bar not green; at 1400x1000 and at 800x600."""
    sync_playwright = _playwright()
    from playwright.sync_api import expect  # after _playwright(): it skips or fails without the package

    dep = deployment(2, admin_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _traffic(dep.url, {})
    for i in range(12):  # more rows than fit one screen above the row clicked below
        converse(dep.url, f"agent-{i:02d}", 2)
    requests: list[str] = []
    errors: list[str] = []
    OUTPUT.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_context(viewport={"width": 800, "height": 600}).new_page()
            page.set_default_timeout(15_000)
            page.on("request", lambda r: requests.append(r.url))
            page.on(
                "console",
                lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None,
            )
            page.on("pageerror", lambda e: errors.append(str(e)))

            # no token: a small login page (a 401, but a page), a wrong token is told, the right one opens
            answer = page.goto(dep.url + "/dashboard")
            assert answer is not None and answer.status == 401
            assert "admin token" in page.inner_text("form#login")
            page.screenshot(path=str(OUTPUT / "login-800x600.png"))
            page.fill("#login-token", "not-the-token")
            page.click("form#login button")
            page.wait_for_selector("#refused:not([hidden])")
            page.fill("#login-token", TOKEN)
            page.click("form#login button")
            expect(page.locator("#kpi-window")).to_have_text(re.compile(r"%$"), timeout=WAIT_MS)
            assert "token=" not in page.url  # the page keeps it, the address bar does not

            # latency, rate, errors, 429s, the policy and its settings
            assert page.inner_text("#kpi-ttfb").count(" ms") == 2
            assert float(page.inner_text("#kpi-rate")) > 0
            assert page.inner_text("#kpi-errors") == "0" and page.inner_text("#kpi-429") == "0"
            assert page.inner_text("#kpi-policy") == "prefix_affinity"
            settings = page.inner_text("#settings")
            for fragment in (
                "policy",
                "prefix_affinity",
                "canonicalization",
                "admission",
                f"on, budget {DEFAULT_TARGET_FRACTION:.1%}",  # the default, as a share of each pool
                "session idle TTL\nlearned",  # no --session-idle-ttl: not "null s"
                "admission wait\nlearned",
            ):
                assert fragment in settings
            # at 800 px nothing runs off the side of the page (the sessions table scrolls in its panel)
            assert page.evaluate("document.documentElement.scrollWidth") <= 800
            page.screenshot(path=str(OUTPUT / "dashboard-800x600.png"))

            # the drill-down opens right under the row clicked, on screen
            row = page.locator('tr.session-row[data-key="agent-gamma"]')
            row.scroll_into_view_if_needed()
            row.click()
            page.wait_for_selector('#session-detail[data-key="agent-gamma"]:not([hidden])')
            assert page.evaluate(
                "document.querySelector('tr.session-row[data-key=\"agent-gamma\"]')"
                ".nextElementSibling.contains(document.getElementById('session-detail'))"
            )
            row_box = row.bounding_box()
            detail_box = page.locator("#session-detail").bounding_box()
            assert row_box is not None and detail_box is not None
            assert 0 <= detail_box["y"] - (row_box["y"] + row_box["height"]) <= 2
            assert 0 <= detail_box["y"] < 600
            page.screenshot(path=str(OUTPUT / "drilldown-800x600.png"))

            page.set_viewport_size({"width": 1400, "height": 1000})
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(OUTPUT / "dashboard-1400x1000.png"))

            # a rank that goes down: its bar turns grey and hatched, never green (the rank holding
            # the most sessions, so that its bar is not empty)
            ranks = httpx.get(dep.url + "/admin/overview", headers=auth, trust_env=False).json()["ranks"]
            held = max(ranks, key=lambda r: r["working_set_tokens"])
            other = next(r["name"] for r in ranks if r is not held)
            assert held["working_set_tokens"] > 0
            victim = next(r for r in dep.ranks if r.name == held["name"])
            victim.set_faults(refuse_connections=True)
            down = page.locator(f'.rank.down[data-rank="{victim.name}"] .bar .fill.down')
            down.wait_for()
            style = down.evaluate(
                "e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).backgroundImage]"
            )
            assert style[0] != "rgb(26, 158, 85)" and "repeating-linear-gradient" in style[1], style
            assert "DOWN" in page.inner_text(f'.rank[data-rank="{victim.name}"]')
            up_style = page.locator(f'.rank[data-rank="{other}"] .bar .fill').evaluate(
                "e => getComputedStyle(e).backgroundColor"
            )
            assert up_style == "rgb(26, 158, 85)"
            page.screenshot(path=str(OUTPUT / "rank-down-1400x1000.png"))
        finally:
            browser.close()

    assert not errors, errors
    assert requests and all(u.startswith(dep.url + "/") for u in requests), requests
