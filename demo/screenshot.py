"""Regenerate docs/demo.png: start the app (``python -m hf_specdec.demo.app``), run one comparison in headless
Chromium, capture the page.

    python demo/screenshot.py                          # default pair, plain vs hf_specdec adaptive, 64 tokens
    python demo/screenshot.py --tiny --out /tmp/x.png  # the offline tiny pair
    python demo/screenshot.py --tiny --modes plain hf_specdec lookahead --out /tmp/demo_tiny.png

Needs Debian's chromium (/usr/bin/chromium) and `pip install playwright` (no `playwright install`).
"""

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE.parent / "docs" / "demo.png"))
    parser.add_argument("--modes", nargs="+", default=["plain", "hf_specdec"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--example", type=int, default=0, help="index of the built-in example prompt")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for loading + the run")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args, app_args = parser.parse_known_args(argv)  # the rest (--tiny, --target, ...) goes to the app
    from hf_specdec.demo import app  # its constants: the example prompts and the mode checkboxes

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "hf_specdec.demo.app", "--host", "127.0.0.1", "--port",
                               str(port), *app_args])
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + args.timeout
        while True:  # main() preloads the models before it serves the page
            if server.poll() is not None:
                print(f"the app exited with {server.returncode}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    print("the app did not start in time", file=sys.stderr)
                    return 1
                time.sleep(1)

        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector("#run", timeout=120_000)
            page.locator("#prompt textarea").fill(app.EXAMPLES[args.example])
            for key, label in app.PANES.items():
                box = page.get_by_label(label, exact=True)
                box.check() if key in args.modes else box.uncheck()
            number = page.locator("#max-new-tokens input[type=number]")
            number.fill(str(args.max_new_tokens))
            number.press("Enter")
            page.click("#run")
            done = "document.querySelector('#status')?.innerText.includes('Done')"
            page.wait_for_function(done, timeout=args.timeout * 1000)
            page.wait_for_selector("#rounds-plot img", timeout=60_000)
            time.sleep(1.0)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            print(page.locator("#status").inner_text())
            print(page.locator("#summary").inner_text())
            browser.close()
        print(f"wrote {args.out}")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
