"""Screenshots of the web page (docs/webui_chat.png, docs/webui_monitor.png) in Debian's Chromium.

    python scripts/webui_screenshots.py [--out docs] [--load-seconds 12]

Serves the default model (SmolLM2-135M-Instruct, under `localserve serve`'s defaults for it) with a
small KV pool of 192 blocks and 8 slots, opens the page in headless Chromium (the browser tests' flags,
tests/webui/conftest.py), asks for a Python function in the chat (markdown, a highlighted code block),
then puts the server under load (6 clients, each asking for long answers over and over, some with two
samples, all with the same system prompt so the prefix cache shares its blocks) and takes the chat
beside the monitor, then the monitor alone with one request chosen in the slots table. Takes about a
minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchlib import ROOT, import_test_helpers

import_test_helpers()  # tests.helpers, without the repository root on sys.path

from localserve.loading.default_model import resolve_default_model  # noqa: E402
from localserve.loading.sampling_defaults import sampling_defaults  # noqa: E402
from tests.helpers.browser import CHROMIUM, CHROMIUM_FLAGS, ensure_chromium  # noqa: E402
from tests.helpers.server import make_llm, running_server  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in full sentences and give examples where they help."
QUESTIONS = ["Explain how a hash table works.", "Write a short story about a lighthouse keeper.",
             "What are the planets of the solar system?", "Describe how bread is made.",
             "Why is the sky blue?", "Give me ten tips for learning a language."]
CHAT_QUESTION = "Write a Python function that checks whether a word is a palindrome, with an example."


def load_client(port: int, index: int, stop: threading.Event) -> None:
    """Ask for long answers until told to stop."""
    while not stop.is_set():
        body = {"messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
                "max_tokens": 300, "temperature": 0.8, "n": 2 if index % 3 == 0 else 1}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=120).read()
        except OSError:
            return  # the server is going away


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--load-seconds", type=float, default=12.0)
    args = parser.parse_args()
    reason = ensure_chromium()
    if reason is not None:
        print(f"no browser: {reason}", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    model_path = resolve_default_model()
    llm = make_llm(model_path, num_kv_blocks=192, max_num_seqs=8, max_model_len=2048)
    defaults = sampling_defaults(model_path, is_default_model=True)
    stop = threading.Event()
    with running_server(llm, sampling_defaults=defaults, monitor_interval_s=0.2) as server, \
            sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1150})
        page.goto(f"http://127.0.0.1:{server.port}/?view=both")
        page.wait_for_selector("body[data-ready=true]")
        page.fill("#prompt", CHAT_QUESTION)
        page.press("#prompt", "Enter")
        page.wait_for_selector(".message.assistant .regenerate", timeout=120_000)
        clients = [threading.Thread(target=load_client, args=(server.port, index, stop), daemon=True)
                   for index in range(6)]
        for client in clients:
            client.start()
        time.sleep(args.load_seconds)
        page.click("#slots tbody tr[data-label]")
        args.out.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out / "webui_chat.png"))
        page.click("#views [data-view=monitor]")
        time.sleep(1.0)
        page.screenshot(path=str(args.out / "webui_monitor.png"))
        stop.set()
        browser.close()
    print(f"wrote {args.out / 'webui_chat.png'} and {args.out / 'webui_monitor.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
