"""The chat playground at GET / driven in headless Chromium against a real running server.

Needs Debian's chromium at /usr/bin/chromium (scripts/setup_browser.sh installs it); skips without it.
Uses the `server` fixture (tests/serve/conftest.py): a running server on a tiny chat model, with
`base_url` like "http://127.0.0.1:41234".
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup_browser.sh"
PAGE = ROOT / "unified" / "serve" / "static" / "index.html"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
NUMBER = re.compile(r"^\d+(\.\d+)?%?$")

# Records every state of the last assistant message's text: each update of the streamed text (the page
# replaces the message's text node) is one mutation record, so updates are counted even when the
# browser delivers several of them to the observer at once.
OBSERVE = """() => {
  window.__lengths = [];
  const record = () => {
    const all = document.querySelectorAll('#messages .assistant');
    if (all.length) window.__lengths.push(all[all.length - 1].textContent.length);
  };
  new MutationObserver((records) => {
    for (const r of records) {
      for (const n of r.addedNodes) if (n.nodeType === Node.TEXT_NODE && n.parentElement
          && n.parentElement.classList.contains('assistant')) window.__lengths.push(n.data.length);
      if (r.type === 'characterData') record();
    }
    record();
  }).observe(document.querySelector('#messages'), {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed by scripts/setup_browser.sh unless UNIFIED_NO_BROWSER_INSTALL is set."""
    if os.path.exists(CHROMIUM):
        pass
    elif os.environ.get("UNIFIED_NO_BROWSER_INSTALL"):
        pytest.skip(f"{CHROMIUM} is missing (run scripts/setup_browser.sh; UNIFIED_NO_BROWSER_INSTALL is set)")
    else:
        try:  # when it cannot install, it prints why on stderr and exits 0
            why = subprocess.run(["bash", str(SETUP)], timeout=600, capture_output=True, text=True).stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"scripts/setup_browser.sh did not run: {exc}"
        if not os.path.exists(CHROMIUM):
            pytest.skip(f"{CHROMIUM} is missing: {why or 'scripts/setup_browser.sh could not install it'}")
    pytest.importorskip("playwright.sync_api", reason="playwright (the Python package) is not installed")
    return CHROMIUM


@pytest.fixture
def page(chromium):
    """A fresh page in headless Debian chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1200, "height": 800})
        finally:
            browser.close()


def _collect_errors(page) -> list[str]:
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def test_playground_streams_a_chat_answer_and_shows_live_gauges(page, server):
    from playwright.sync_api import expect

    errors = _collect_errors(page)
    page.goto(server.base_url + "/")
    status = page.locator("#status")
    expect(status).to_have_attribute("data-phase", "ready", timeout=180_000)
    expect(status).to_have_text(re.compile("ready", re.I))
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()

    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")
    page.evaluate(OBSERVE)
    # A tiny model on a quiet host answers within one network read; a slow link makes the stream arrive in
    # pieces, as it does from a real model, so that the page's incremental rendering is what gets checked.
    network = page.context.new_cdp_session(page)
    network.send("Network.enable")
    network.send("Network.emulateNetworkConditions",
                 {"offline": False, "latency": 0, "downloadThroughput": 4000, "uploadThroughput": -1})
    page.fill("#prompt", "Tell me a short story about a cat.")
    page.click("#send")

    # While the answer streams the Stop button is live; when it ends Send comes back.
    assistant = page.locator("#messages .assistant").last
    expect(assistant).to_be_visible()
    expect(page.locator("#send")).to_be_enabled(timeout=120_000)
    expect(page.locator("#stop")).to_be_disabled()

    text = assistant.text_content() or ""
    assert text.strip(), "the assistant message is empty"
    assert "error" not in (assistant.get_attribute("class") or ""), f"the request failed: {text}"
    lengths = page.evaluate("window.__lengths")
    grew = sorted({n for n in lengths if 0 < n <= len(text)})
    assert len(grew) >= 2, f"the answer was not streamed (text lengths seen: {lengths})"
    assert grew[-1] == len(text)

    # The gauges poll /metrics every second; tokens/s needs two polls.
    for gauge in ("#kv-usage", "#running", "#waiting", "#tokens-per-s"):
        expect(page.locator(gauge)).to_have_text(NUMBER, timeout=10_000)
    assert errors == [], errors


def test_playground_shows_startup_progress_and_errors(page):
    """Against canned responses (no server): startup phases, a failed start, and an API error."""
    from playwright.sync_api import expect

    health = {"status": "starting", "phase": "loading_weights", "progress": {"weights": {"done": 30, "total": 120}}}
    sent: list[dict] = []

    def fulfil(route):
        path = route.request.url.split("playground.test", 1)[1]
        if path == "/":
            return route.fulfill(path=str(PAGE), content_type="text/html")
        if path == "/health":
            return route.fulfill(status=200 if health["status"] == "ready" else 503, json=health)
        if path == "/v1/models":
            return route.fulfill(json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if path == "/v1/chat/completions":
            sent.append(json.loads(route.request.post_data))
            return route.fulfill(status=400, json={"error": {"message": "prompt is too long", "type": "invalid_request_error",
                                                             "code": None}})
        return route.fulfill(status=404, body="not found")  # /metrics: the gauges show dashes

    errors = _collect_errors(page)
    page.route("http://playground.test/**", fulfil)
    page.goto("http://playground.test/")

    expect(page.locator("#status")).to_have_text("Loading weights")
    expect(page.locator("#weights")).to_contain_text("30 / 120")
    expect(page.locator("#warmup")).to_be_hidden()
    expect(page.locator("#send")).to_be_disabled()
    health.update(phase="warming_up", progress={"warmup": {"done": 3, "total": 8}})
    expect(page.locator("#warmup")).to_contain_text("3 / 8")
    expect(page.locator("#weights")).to_be_hidden()
    health.update(phase="failed", message="out of memory during warm-up")
    expect(page.locator("#status")).to_have_attribute("data-phase", "failed")
    expect(page.locator("#startup-msg")).to_have_text("out of memory during warm-up")
    expect(page.locator("#send")).to_be_disabled()
    for gauge in ("#kv-usage", "#running", "#waiting", "#tokens-per-s"):
        expect(page.locator(gauge)).to_have_text("\u2013")

    health.clear()
    health.update(status="ready", phase="ready", model="tiny")
    expect(page.locator("#send")).to_be_enabled(timeout=10_000)
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    expect(page.locator("#messages .assistant").last).to_have_text("prompt is too long")
    assert sent[0]["model"] == "tiny" and sent[0]["stream"] is True
    assert sent[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert sent[0]["stream_options"] == {"include_usage": True}
    assert errors == [], errors
