"""End to end: the demo in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright for Python).

Starts ``python -m hf_specdec.demo.app --tiny`` (offline random tiny pair) on a free localhost port in a subprocess, opens
the page, selects two modes (plain and transformers assisted), runs a prompt, and checks that both panes
filled, their metrics show numbers, accepted draft tokens are highlighted, and the summary line appeared.

CI needs: `apt-get install -y chromium` and `pip install playwright` (no `playwright install`: the Debian
browser is used through executable_path). See docs/demo.md.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing: apt-get install -y chromium"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright missing: pip install playwright"),
    pytest.mark.skipif(importlib.util.find_spec("gradio") is None, reason="gradio missing: pip install gradio"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "server.log"
    with open(log, "w") as out:
        command = [sys.executable, "-m", "hf_specdec.demo.app", "--tiny", "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the demo exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"the demo did not answer on {url} within 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_modes_stream_into_panes_with_metrics_and_highlights(server_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(server_url, wait_until="domcontentloaded")
            page.wait_for_selector("#run", timeout=60_000)
            page.locator("#prompt textarea").fill("Write a Python function that reverses a linked list.")
            page.get_by_label("hf_specdec", exact=True).uncheck()  # two modes: plain and transformers assisted
            page.get_by_label("Transformers assisted").check()
            page.click("#run")
            summary_done = "document.querySelector('#summary')?.innerText.includes('Output vs plain')"
            page.wait_for_function(summary_done, timeout=90_000)

            for mode in ("plain", "assisted"):
                pane = page.locator(f'#pane-{mode} .hfsd-pane[data-status="done"]')
                assert pane.count() == 1, f"{mode} pane did not finish"
                assert pane.locator(".hfsd-text").inner_text().strip(), f"{mode} pane is empty"
                tok_s = pane.locator('[data-metric="tok_s"]').inner_text()
                assert re.search(r"tokens/s\s+\d+\.\d", tok_s), tok_s
                for key in ("ttft", "elapsed", "mal", "acceptance"):
                    assert pane.locator(f'[data-metric="{key}"]').is_visible()
            assert page.locator('#pane-hf_specdec').is_hidden() and page.locator('#pane-lookahead').is_hidden()
            assert page.locator("#pane-assisted .hfsd-draft").count() > 0  # accepted draft tokens highlighted
            assert page.locator("#pane-plain .hfsd-draft").count() == 0
            summary = page.locator("#summary").inner_text()
            assert "Speedup over plain on this prompt" in summary and "identical" in summary
            assert "one after another for honest timings" in page.locator("#status").inner_text()
            page.wait_for_selector("#rounds-plot img", timeout=30_000)
        finally:
            browser.close()
