"""The demo in a real browser: Debian's headless Chromium driven by playwright (no download)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_demo import served  # noqa: F401  (the served app fixture)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parent.parent / "reports"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("Chromium is missing: install Debian's chromium package (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def test_two_strategies_stream_side_by_side_with_probabilities_and_stats(served, browser):  # noqa: F811
    url, _, _ = served
    page = browser.new_page(viewport={"width": 1400, "height": 1600})
    requests_out = []
    page.on("request", lambda request: requests_out.append(request.url))
    page.goto(url, timeout=120_000)  # the first page load compiles the front end; a busy machine takes long
    page.get_by_label("Prompt").fill("Tell me about the sea")
    presets = page.get_by_label("Preset")
    presets.nth(1).click()
    page.get_by_role("option", name="top-p 0.9, T=0.8").click()
    page.get_by_role("button", name="Run").click()
    finished = page.get_by_text("total time (s)")
    finished.nth(1).wait_for(timeout=60_000)
    assert finished.count() == 2  # both panels ended their stream
    assert page.locator(".score-token").count() > 8  # the probability-shaded tokens of both outputs
    assert page.get_by_text("tokens/s").count() == 2 and page.get_by_text("full KV cache (KiB)").count() == 2
    assert page.get_by_text("Top candidates at that step").count() == 2
    legends = page.locator(".role-legend-label")  # the before/after bar plots were drawn
    legends.first.wait_for(timeout=10_000)
    assert {legends.nth(i).text_content() for i in range(legends.count())} >= {"before processors", "after processors"}
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "demo-browser-test.png"), full_page=True)
    assert all(request.startswith(url.rstrip("/")) or request.startswith("data:") for request in requests_out), [
        request for request in requests_out if not request.startswith(url.rstrip("/"))
    ]
    page.close()
