"""Drive a running localserve with chat traffic, so that its TUI has something to show.

    python scripts/load.py [ws://127.0.0.1:8080] [--clients 8] [--duration 60] [--max-tokens 96] [--seed 0]

Each client opens its own connection and, until the duration is over, sends a prompt cut from real
English text (the licences in /usr/share/common-licenses) asking for a summary, with a random
output length; one turn in three continues the client's previous response (previous_response_id),
so the prefix cache gets hits. Prompts grow with the turn number, so a small pool fills and requests
get preempted. It stops by itself after `--duration` seconds (plus the replies in flight) and prints
one line per client. Only for servers on this machine: it refuses any host but loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import time
from pathlib import Path
from urllib.parse import urlsplit

from websockets.asyncio.client import connect

TEXT_FOLDER = Path("/usr/share/common-licenses")
CLOSING_EVENTS = ("response.completed", "response.incomplete", "response.failed", "error")


def english_words() -> list[str]:
    words: list[str] = []
    for path in sorted(TEXT_FOLDER.glob("*")):
        if path.is_file():
            words += path.read_text(errors="replace").split()
    return words or "the quick brown fox jumps over the lazy dog".split()


def check_loopback(url: str) -> None:
    host = urlsplit(url if "://" in url else f"ws://{url}").hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"load.py drives servers on this machine only, not {host}")


async def client(index: int, url: str, words: list[str], args: argparse.Namespace, deadline: float) -> str:
    rng = random.Random(args.seed * 1000 + index)
    num_responses = num_tokens = num_cached = num_errors = 0
    previous_id = None
    async with connect(url, max_size=None) as connection:
        while time.monotonic() < deadline:
            start = rng.randrange(len(words) - 600)
            length = rng.randrange(20, 120) + 10 * num_responses
            prompt = "Summarize: " + " ".join(words[start:start + length])
            create = {"type": "response.create", "input": prompt,
                      "max_output_tokens": rng.randrange(8, args.max_tokens + 1)}
            if previous_id is not None and rng.random() < 1 / 3:
                create |= {"previous_response_id": previous_id, "input": "Go on."}
            await connection.send(json.dumps(create))
            while True:
                event = json.loads(await connection.recv())
                if event["type"] in CLOSING_EVENTS:
                    break
            if event["type"] == "error" or event["type"] == "response.failed":
                num_errors += 1
                previous_id = None
                continue
            usage = event["response"]["usage"]
            num_responses += 1
            num_tokens += usage["output_tokens"]
            num_cached += usage["input_tokens_details"]["cached_tokens"]
            previous_id = event["response"]["id"]
    return (f"client {index}: {num_responses} responses, {num_tokens} tokens generated, "
            f"{num_cached} prompt tokens from the cache, {num_errors} errors")


async def main(args: argparse.Namespace) -> None:
    url = args.url if "://" in args.url else f"ws://{args.url}"
    url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1/responses") else "/v1/responses")
    words = english_words()
    deadline = time.monotonic() + args.duration
    for line in await asyncio.gather(*(client(i, url, words, args, deadline) for i in range(args.clients))):
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", nargs="?", default="ws://127.0.0.1:8080")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    check_loopback(arguments.url)
    asyncio.run(main(arguments))
