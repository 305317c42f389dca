"""Web page benchmark: how long the page takes to draw a monitor frame of a 65,536-block pool, and
whether its memory stays flat over minutes of frames. In Debian's Chromium (headless), no server.

    python scripts/bench_webui.py [--num-blocks 65536] [--frames 15] [--minutes 10] [--interval 0.2]

Prints markdown tables (docs/BENCHMARKS.md, "Web page"). Takes `--minutes` plus about a minute.

The page is served to the browser by Playwright's request routing from the package's own files (the
same bytes and headers as `GET /`, server/web_ui.py), and its `/v1/monitor` websocket is answered by
Playwright too, with frames built as scripts/bench_tui.py builds them (256 requests whose block tables
cover 3/4 of the pool, a tenth replaced each frame, 10 events a frame): "fragmented" (every block's
state at random: 65,536 runs) and "runs" (contiguous runs).

- Frame time: for each frame, the page's own measure (`#monitor[data-frame-ms]`): from the websocket
  message to the frame drawn (JSON.parse, run-length decoding, the block map's canvas, the legend, the
  slots table, the trends, the event log); and `data-map-ms`, the block map alone (cells coloured and
  the canvas written). Target: at most 16 ms (60 frames a second). Two windows: 1400x900 with chat
  and monitor side by side, 1920x1080 with the monitor alone.
- Memory: frames every `--interval` seconds for `--minutes`; every 30 s a garbage collection, then
  the JS heap in use (DevTools' Runtime.getHeapUsage) and the DOM's node count. Flat means the slope
  of a least-squares line through the samples after the first minute is near zero.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

from benchlib import import_test_helpers

import_test_helpers()  # tests.helpers, without the repository root on sys.path

from bench_tui import NUM_REQUESTS, build_frames  # noqa: E402

from localserve.server.web_ui import SECURITY_HEADERS, WebUi  # noqa: E402
from tests.helpers.browser import CHROMIUM, CHROMIUM_FLAGS, ensure_chromium  # noqa: E402
from tests.helpers.monitor_frames import hello_frame  # noqa: E402

ORIGIN = "http://bench.localserve"
MODEL = {"object": "list", "data": [{"id": "bench", "object": "model", "max_model_len": 2048,
                                     "sampling_defaults": {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                                           "min_p": 0.05, "source": "bench"}}]}
WINDOWS = (("1400x900 chat+monitor", {"width": 1400, "height": 900}, "both"),
           ("1920x1080 monitor", {"width": 1920, "height": 1080}, "monitor"))
SAMPLE_EVERY_S = 30.0


class BenchPage:
    """A page of the web UI whose monitor socket this script feeds."""

    def __init__(self, browser, viewport: dict, view: str, hello: dict) -> None:
        site = WebUi.from_package()
        headers = {name.decode(): value.decode() for name, value in SECURITY_HEADERS}
        self.page = browser.new_page(viewport=viewport)
        self.page.on("console", lambda message: print("page console:", message.type, message.text, file=sys.stderr))
        self.devtools = self.page.context.new_cdp_session(self.page)
        self.devtools.send("Performance.enable")
        self.sockets = []

        def serve(route) -> None:
            path = route.request.url.removeprefix(ORIGIN).split("?")[0]
            if path == "/v1/models":
                return route.fulfill(status=200, json=MODEL)
            if path == "/v1/monitor/ticket":
                return route.fulfill(status=200, json={"ticket": "bench", "expires_in_s": 30})
            static = site.find(path)
            if static is None:
                return route.fulfill(status=404, body="not found")
            return route.fulfill(status=200, body=static.body, headers={**headers, "content-type": static.content_type})

        def monitor(socket) -> None:
            self.sockets.append(socket)
            socket.send(json.dumps(hello))

        self.page.route(f"{ORIGIN}/**", serve)
        self.page.route_web_socket("ws://bench.localserve/v1/monitor*", monitor)
        self.page.goto(f"{ORIGIN}/?view={view}")
        self.page.wait_for_selector("body[data-ready=true]")
        while not self.sockets:
            self.page.wait_for_timeout(20)
        self.page.wait_for_function("() => document.querySelector('#map-title').textContent !== ''")
        self.num_sent = 0

    def send(self, frame: dict) -> None:
        """Send `frame` as the next snapshot (its time, step and event numbers made to follow on)."""
        self.num_sent += 1
        frame["time"], frame["num_steps"] = 1764400000.0 + self.num_sent * 0.2, self.num_sent
        for index, event in enumerate(frame["events"]):
            event["seq"] = self.num_sent * 100 + index
        self.sockets[0].send(json.dumps(frame))

    def main_thread_s(self) -> dict[str, float]:
        """The renderer's main-thread time so far (DevTools' Performance metrics, seconds)."""
        answer = self.devtools.send("Performance.getMetrics")
        metrics = {metric["name"]: metric["value"] for metric in answer["metrics"]}
        return {"task": metrics["TaskDuration"], "script": metrics["ScriptDuration"],
                "layout": metrics["LayoutDuration"] + metrics["RecalcStyleDuration"]}

    def drawn(self) -> tuple[float, float]:
        """Wait for the last frame sent to be drawn: (frame ms, map ms) as the page measured them."""
        self.page.wait_for_function("(step) => document.querySelector('#block-map').dataset.numSteps === String(step)",
                                    arg=self.num_sent)
        data = self.page.evaluate("() => ({...document.querySelector('#monitor').dataset})")
        return float(data["frameMs"]), float(data["mapMs"])


def frame_times(browser, hello: dict, frames: dict[str, list[dict]]) -> None:
    print("| pool | window | frame size | frame ms, median (max) | block map ms, median (max) "
          "| main thread ms/frame: all (script, style+layout) |")
    print("|---|---|---|---|---|---|")
    for window, viewport, view in WINDOWS:
        bench = BenchPage(browser, viewport, view, hello)
        for pool, pool_frames in frames.items():
            bench.send(copy.deepcopy(pool_frames[0]))  # a first frame of this pool, not measured
            bench.drawn()
            timings = []
            before = bench.main_thread_s()
            for frame in pool_frames:
                bench.send(copy.deepcopy(frame))
                timings.append(bench.drawn())
                bench.page.wait_for_timeout(50)
            after = bench.main_thread_s()
            main = {name: (after[name] - before[name]) * 1000 / len(pool_frames) for name in after}
            size_kib = statistics.median(len(json.dumps(frame)) for frame in pool_frames) / 1024
            frame_ms, map_ms = zip(*timings)
            print(f"| {pool} | {window} | {size_kib:,.0f} KiB "
                  f"| {statistics.median(frame_ms):.1f} ({max(frame_ms):.1f}) "
                  f"| {statistics.median(map_ms):.1f} ({max(map_ms):.1f}) | {main['task']:.1f} ({main['script']:.1f}, "
                  f"{main['layout']:.1f}) |", flush=True)
        bench.page.close()


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    times, values = zip(*samples)
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(values)
    return sum((t - mean_t) * (v - mean_v) for t, v in samples) / sum((t - mean_t) ** 2 for t in times) * 60


def memory(browser, hello: dict, frames: list[dict], minutes: float, interval_s: float) -> None:
    bench = BenchPage(browser, WINDOWS[0][1], WINDOWS[0][2], hello)
    devtools = bench.devtools
    started = time.monotonic()
    next_sample = 0.0
    heap, nodes, num_frames = [], [], []
    while (elapsed := time.monotonic() - started) < minutes * 60:
        if elapsed >= next_sample:
            devtools.send("HeapProfiler.collectGarbage")
            heap.append((elapsed, devtools.send("Runtime.getHeapUsage")["usedSize"] / 2**20))
            nodes.append((elapsed, devtools.send("Memory.getDOMCounters")["nodes"]))
            num_frames.append(bench.num_sent)
            print(f"  {elapsed:5.0f} s: {heap[-1][1]:.3f} MiB heap, {nodes[-1][1]} DOM nodes, "
                  f"{bench.num_sent} frames", file=sys.stderr, flush=True)
            next_sample += SAMPLE_EVERY_S
        bench.send(copy.deepcopy(frames[bench.num_sent % len(frames)]))
        bench.page.wait_for_timeout(interval_s * 1000)
    bench.drawn()
    settled_heap = [sample for sample in heap if sample[0] >= 60]
    settled_nodes = [sample for sample in nodes if sample[0] >= 60]
    print(f"\n{bench.num_sent:,} frames in {minutes:g} min ({interval_s:g} s apart), 1400x900, chat+monitor\n")
    print("| | after 1 min | at the end | slope after the first minute |")
    print("|---|---|---|---|")
    print(f"| JS heap in use | {settled_heap[0][1]:.2f} MiB | {heap[-1][1]:.2f} MiB | "
          f"{slope_per_minute(settled_heap) * 1024:+.1f} KiB/min |")
    print(f"| DOM nodes | {settled_nodes[0][1]:,} | {nodes[-1][1]:,} | {slope_per_minute(settled_nodes):+.1f} /min |")
    # The trends keep WINDOW_S (300 s) of the frames' own clock, 0.2 s a frame here: until that many
    # frames have come the heap grows by design; from then on it should not.
    full = [sample for sample, count in zip(heap, num_frames) if count >= 300 / 0.2]
    if len(full) >= 2:
        print(f"| JS heap once the trends' 5 minutes are full ({len(full)} samples) | {full[0][1]:.3f} MiB "
              f"| {full[-1][1]:.3f} MiB | {slope_per_minute(full) * 1024:+.1f} KiB/min |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=65536)
    parser.add_argument("--frames", type=int, default=15)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reason = ensure_chromium()
    if reason is not None:
        print(f"no browser: {reason}", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    hello = hello_frame(args.num_blocks, max_num_seqs=NUM_REQUESTS)
    frames = {name: [json.loads(text) for text in build_frames(args.num_blocks, args.frames, fragmented, args.seed)]
              for name, fragmented in (("fragmented", True), ("runs", False))}
    print(f"{args.num_blocks:,} blocks, {NUM_REQUESTS} requests, {args.frames} frames per pool; Chromium headless\n")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        frame_times(browser, hello, frames)
        if args.minutes > 0:
            memory(browser, hello, frames["fragmented"], args.minutes, args.interval)
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
