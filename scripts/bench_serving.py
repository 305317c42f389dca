"""Serving latency under load, over websockets: what a chat user feels while others use the server.

A load generator for any server that speaks OpenAI's Responses WebSocket mode (DESIGN.md section 7):
it points at `--url`, or starts `localserve serve` on a free port itself. For each load (concurrent
streams x request rate) it sends requests with Poisson arrivals (rate `inf`: all at once), at most
that many streams in flight, each on its own connection; prompts are cut from real English text
(/usr/share/common-licenses) and prompt / output lengths drawn from a fixed-seed distribution, with
an optional shared system prompt. Reported per load: time to first token (TTFT), inter-token latency
(ITL, between successive text deltas) at p50 / p90 / p99 / max, end-to-end latency, request and
output-token throughput, preemptions (from /metrics). Prints a table, writes raw numbers and a plot.

`--prefix-cache` instead measures the TTFT of one request whose long system prompt (2,000 tokens by
default) is cold, cached by an earlier request, and warmed with `generate: false`.

    python scripts/bench_serving.py [--url ws://127.0.0.1:8080] [--concurrency 1 4 16 64] \
        [--rates inf] [--requests-per-stream 4] [--system-prompt-words 0] [--png docs/bench/serving.png]
    python scripts/bench_serving.py --prefix-cache [--system-prompt-words 1750]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from benchlib import DOCS, bar_chart, machine, markdown_table, percentile, print_machine, save_raw
from websockets.asyncio.client import connect

CLOSING = ("response.completed", "response.incomplete", "response.failed", "error")
WORDS = re.findall(r"\S+", "\n".join(Path("/usr/share/common-licenses", name).read_text()
                                     for name in ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1")))


@dataclass
class Result:
    ttft: float = math.nan
    itls: list[float] = field(default_factory=list)
    e2e: float = math.nan
    output_tokens: int = 0
    cached_tokens: int = 0
    status: str = ""


def text_of(rng: np.random.Generator, num_words: int) -> str:
    start = int(rng.integers(0, len(WORDS) - num_words))
    return " ".join(WORDS[start:start + num_words])


async def one_request(url: str, event: dict, headers: dict) -> tuple[Result, str | None]:
    """Send one response.create on a new connection and time its deltas; returns the result and response id."""
    result = Result()
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        sent = time.perf_counter()
        await ws.send(json.dumps(event))
        last = None
        while True:
            message = json.loads(await ws.recv())
            now = time.perf_counter()
            if message["type"] == "response.output_text.delta":
                if last is None:
                    result.ttft = now - sent
                else:
                    result.itls.append(now - last)
                last = now
            elif message["type"] in CLOSING:
                result.e2e = now - sent
                response = message.get("response") or {}
                result.status = response.get("status", message["type"])
                usage = response.get("usage") or {}
                result.output_tokens = usage.get("output_tokens", 0)
                result.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
                if result.ttft != result.ttft and message["type"] == "response.completed":
                    result.ttft = result.e2e  # an empty reply: its first and last event coincide
                return result, response.get("id")


def metric(http_url: str, name: str, headers: dict) -> float:
    """Sum of a Prometheus counter's samples (all label values)."""
    request = urllib.request.Request(f"{http_url}/metrics", headers=headers)
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def run_load(url: str, http_url: str, headers: dict, concurrency: int, rate: float, num_requests: int,
                   system_words: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    system = text_of(rng, system_words) if system_words else None
    events = []
    for _ in range(num_requests):
        event = {"type": "response.create", "temperature": 0,
                 "input": "Summarize: " + text_of(rng, int(rng.integers(20, 300))),
                 "max_output_tokens": int(rng.integers(16, 257))}
        if system:
            event["instructions"] = system
        events.append(event)
    gaps = rng.exponential(1 / rate, num_requests) if math.isfinite(rate) else np.zeros(num_requests)
    preemptions_before = metric(http_url, "localserve_num_preemptions_total", headers)
    limit = asyncio.Semaphore(concurrency)
    results: list[Result] = []

    async def worker(event: dict) -> None:
        async with limit:
            results.append((await one_request(url, event, headers))[0])

    start = time.perf_counter()
    tasks = []
    for gap, event in zip(gaps, events):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(worker(event)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    itls = [gap for result in results for gap in result.itls]
    ttfts = [r.ttft for r in results if r.ttft == r.ttft]
    e2es = [r.e2e for r in results]
    return {"concurrency": concurrency, "rate": rate, "requests": len(results), "seconds": elapsed,
            "ttft": {q: percentile(ttfts, q) for q in (50, 90, 99)},
            "itl": {**{q: percentile(itls, q) for q in (50, 90, 99)}, "max": max(itls, default=math.nan)},
            "e2e": {q: percentile(e2es, q) for q in (50, 90, 99)},
            "requests_per_s": len(results) / elapsed,
            "output_tokens_per_s": sum(r.output_tokens for r in results) / elapsed,
            "preemptions": metric(http_url, "localserve_num_preemptions_total", headers) - preemptions_before,
            "statuses": sorted({r.status for r in results})}


async def prefix_cache(url: str, headers: dict, system_words: int, seed: int) -> dict:
    """TTFT with a long system prompt: cold, cached by an earlier request, and warmed with generate: false."""
    rng = np.random.default_rng(seed)
    question = {"type": "response.create", "temperature": 0, "max_output_tokens": 8}
    cold_system, warm_system = text_of(rng, system_words), text_of(rng, system_words)
    cold, _ = await one_request(url, {**question, "instructions": cold_system, "input": "Who wrote this?"}, headers)
    cached, _ = await one_request(url, {**question, "instructions": cold_system, "input": "Is it long?"}, headers)
    warm = {"type": "response.create", "generate": False, "instructions": warm_system, "input": []}
    _, warm_id = await one_request(url, warm, headers)
    # Instructions are not inherited through previous_response_id (as in OpenAI's API): sent again.
    warmed, _ = await one_request(url, {**question, "previous_response_id": warm_id, "instructions": warm_system,
                                        "input": "Who wrote this?"}, headers)
    return {"system_words": system_words,
            "cold": {"ttft": cold.ttft, "cached_tokens": cold.cached_tokens},
            "cached": {"ttft": cached.ttft, "cached_tokens": cached.cached_tokens},
            "warmed": {"ttft": warmed.ttft, "cached_tokens": warmed.cached_tokens}}


def start_server(args) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "localserve.cli", "serve", "--port", str(port), *args.server_args]
    # Its log goes to a file: a pipe nobody reads would fill and block the server mid-run.
    log = tempfile.NamedTemporaryFile("w+", prefix="bench_serving_", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {Path(log.name).read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server, port
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not come up within 10 minutes")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['concurrency']}@{'inf' if not math.isfinite(r['rate']) else r['rate']}" for r in rows]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(rows))
    for key, quantile, style in (("ttft", 50, "o-"), ("ttft", 99, "o--"), ("itl", 50, "s-"), ("itl", 99, "s--")):
        latency.plot(x, [r[key][quantile] * 1000 for r in rows], style, label=f"{key.upper()} p{quantile}")
    latency.plot(x, [r["itl"]["max"] * 1000 for r in rows], "x:", label="ITL max")
    latency.set_yscale("log")
    latency.set_ylabel("ms")
    throughput.bar(x, [r["output_tokens_per_s"] for r in rows])
    throughput.set_ylabel("output tokens/s")
    for axis in (latency, throughput):
        axis.set_xticks(x, labels, rotation=30)
        axis.set_xlabel("streams @ request rate (req/s)")
    latency.legend(fontsize=8)
    figure.suptitle("localserve over websockets")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server, e.g. ws://127.0.0.1:8080 (default: start one)")
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rates", type=float, nargs="+", default=[math.inf],
                        help="request rates (requests/s) to try at each concurrency; inf: all at once")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--system-prompt-words", type=int, default=0)
    parser.add_argument("--prefix-cache", action="store_true", help="measure the prefix-cache TTFT instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", type=Path, default=DOCS / "serving.png")
    parser.add_argument("server_args", nargs="*", help="after --: flags for the started `localserve serve`")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    server = None
    if args.url is None:
        server, port = start_server(args)
        args.url = f"ws://127.0.0.1:{port}"
    http_url = args.url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/")
    url = http_url.replace("http", "ws", 1) + "/v1/responses"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        if args.prefix_cache:
            words = args.system_prompt_words or 1750  # about 2,000 tokens of SmolLM2
            result = asyncio.run(prefix_cache(url, headers, words, args.seed))
            rows = [[name, f"{result[name]['ttft'] * 1000:.0f}", result[name]["cached_tokens"]]
                    for name in ("cold", "cached", "warmed")]
            print(f"\nTTFT with a system prompt of {words} words\n")
            print(markdown_table(["system prompt", "TTFT (ms)", "cached tokens"], rows))
            print(f"\ncold / cached: {result['cold']['ttft'] / result['cached']['ttft']:.1f}x, "
                  f"cold / warmed: {result['cold']['ttft'] / result['warmed']['ttft']:.1f}x")
            png = bar_chart(args.png.with_name("prefix_cache.png"), f"TTFT, {words}-word system prompt",
                            ["cold", "cached", "warmed"],
                            {"TTFT (ms)": [result[name]["ttft"] * 1000 for name in ("cold", "cached", "warmed")]},
                            "ms", log=True)
            print(f"plot: {png}; raw numbers: {save_raw('prefix_cache', info, result)}")
            return
        runs = []
        for concurrency in args.concurrency:
            for rate in args.rates:
                run = asyncio.run(run_load(url, http_url, headers, concurrency, rate,
                                           concurrency * args.requests_per_stream, args.system_prompt_words,
                                           args.seed))
                runs.append(run)
                print(f"  {concurrency} streams @ {rate} req/s: {run['output_tokens_per_s']:.1f} tokens/s",
                      file=sys.stderr)
        rows = [[r["concurrency"], r["rate"], r["requests"], *(f"{r['ttft'][q] * 1000:.0f}" for q in (50, 99)),
                 *(f"{r['itl'][q] * 1000:.0f}" for q in (50, 90, 99, "max")), f"{r['e2e'][50]:.1f}",
                 f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}", int(r["preemptions"]),
                 f"{r['itl'][99] / r['itl'][50]:.1f}"] for r in runs]
        print()
        print(markdown_table(["streams", "rate (req/s)", "requests", "TTFT p50 (ms)", "TTFT p99", "ITL p50 (ms)",
                              "ITL p90", "ITL p99", "ITL max", "E2E p50 (s)", "req/s", "output tok/s",
                              "preemptions", "ITL p99/p50"], rows))
        raw = save_raw(args.png.stem, info, runs)  # first: the plot needs the bench extra (matplotlib)
        print(f"\nraw numbers: {raw}")
        plot(runs, args.png)
        print(f"plot: {args.png}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
