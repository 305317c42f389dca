// The monitor: the block map, the slots, the trends, the events and the capacity per KV format, drawn
// from /v1/monitor's frames (docs/PROTOCOL.md) with the TUI's meanings (tui/app.py and its panels).

import { BlockMap } from "./block_map.js";
import {
  CPU_STATE_CHARS, EMPTY, GPU_STATE_CHARS, STATE_CLASSES, STATE_NAMES, SWAPPED, countStates, decodeBlockStates,
} from "./block_states.js";
import { clockTime, el, formatCount, replaceChildren } from "./dom.js";
import { FeedHistory, WINDOW_S } from "./history.js";
import { imageBlocks, imageCount } from "./image_spans.js";
import { describeSwitch } from "./monitor_feed.js";
import { Trends } from "./trends.js";

const MAX_EVENTS = 500; // lines kept in the event log; the oldest go first
const QUIET_EVENTS = new Set(["prefill_chunk", "first_token"]); // one per request per step: they would drown the rest
const BAD_EVENTS = new Set(["preempted", "failed", "rejected"]);
const SHOWN_STATES = [0, 1, 2, 3]; // free, cached, used, shared: the GPU pool's

/** What happened, in words (tui/event_log.py's `describe`). */
export function describeEvent(event) {
  switch (event.event) {
    case "admitted": return `admitted, ${event.num_prompt_tokens ?? "?"} prompt tokens`;
    case "prefix_hit": return `prefix hit, ${event.num_cached_tokens ?? "?"} tokens from the cache`;
    case "prefill_chunk": return `prefill chunk of ${event.num_tokens ?? "?"} (${event.num_computed_tokens ?? "?"} done)`;
    case "first_token": return "first token";
    case "preempted": return `preempted: ${event.mode ?? "?"}${event.fallback ? " (swap pool full)" : ""}`;
    case "swapped_out": case "swapped_in": case "copy_on_write":
      return `${event.event.replaceAll("_", " ")}, ${event.num_blocks ?? "?"} blocks`;
    case "resumed": return "resumed";
    case "finished": case "failed": case "rejected": return `${event.event}: ${event.reason ?? "?"}`;
    default: {
      const details = Object.entries(event).filter(([key]) => !["seq", "time", "event", "request"].includes(key));
      return [event.event, ...details.map(([key, value]) => `${key}=${value}`)].join(" ");
    }
  }
}

/** The capacity rows: the hello's formats, and the pool's own when they leave it out (bf16, or K and V apart). */
export function capacityRows(hello) {
  const current = hello.cache_type_k === hello.cache_type_v ? hello.cache_type_k
    : `K ${hello.cache_type_k} V ${hello.cache_type_v}`;
  const rows = hello.capacity.map((row) => ({ ...row, now: row.format === current }));
  if (!rows.some((row) => row.now)) {
    const numTokens = hello.num_blocks * hello.block_size;
    rows.unshift({ format: current, bytes_per_token: Math.round(hello.kv_cache_bytes / Math.max(1, numTokens)),
      num_tokens: numTokens, now: true });
  }
  return rows;
}

export class MonitorView {
  constructor(root, statusNode) {
    this.root = root;
    this.statusNode = statusNode;
    this.history = new FeedHistory();
    this.hello = null;
    this.frame = null; // the snapshot on screen
    this.states = new Uint8Array(0);
    this.cpuStates = new Uint8Array(0);
    this.selectedLabel = null;
    this.imageBlocks = []; // the selected request's blocks that hold image tokens
    this.paused = false;
    this.numMissedEvents = 0;
    this.map = new BlockMap(root.querySelector("#block-map"));
    this.swapMap = new BlockMap(root.querySelector("#swap-map"));
    this.trends = new Trends(root.querySelector("#trends"), this.history);
    root.querySelector("#trends-title").textContent = `last ${WINDOW_S / 60} min`;
    this.slotsBody = root.querySelector("#slots tbody");
    this.slotRows = new Map(); // label -> its row, kept from frame to frame (only changed cells are written)
    this.slotsBody.addEventListener("click", (event) => {
      const label = event.target.closest("tr[data-label]")?.dataset.label;
      if (label) this.select(label === this.selectedLabel ? null : label);
    });
    this.events = root.querySelector("#events");
    this.hover = root.querySelector("#map-hover");
    this.map.canvas.addEventListener("mousemove", (event) => this.showHover(event.offsetX, event.offsetY));
    this.map.canvas.addEventListener("mouseleave", () => { this.hover.textContent = ""; });
    this.pauseButton = el("button", { type: "button", id: "pause", onclick: () => this.togglePause() }, "Pause");
    root.querySelector("#map-panel h2").append(" ", this.pauseButton);
    this.pressure = el("div", { id: "pressure", hidden: true });
    root.querySelector("#map-panel h2").after(this.pressure);
    new ResizeObserver(() => this.redraw()).observe(root);
    this.showSlots([]);
  }

  showHello(hello) {
    this.hello = hello;
    this.history.newBaseline();
    this.states = new Uint8Array(hello.num_blocks);
    this.cpuStates = new Uint8Array(hello.num_cpu_blocks);
    const format = hello.cache_type_k === hello.cache_type_v ? hello.cache_type_k
      : `K ${hello.cache_type_k} V ${hello.cache_type_v}`;
    this.root.querySelector("#map-title").textContent =
      `${formatCount(hello.num_blocks)} × ${hello.block_size} tokens · ${format}`;
    this.swapMap.canvas.hidden = hello.num_cpu_blocks === 0;
    this.showCapacity(hello);
    this.addNotice(`connected: ${hello.model}`);
  }

  /** Take in one snapshot: the trends always, the screen unless paused. */
  showSnapshot(frame, receivedAt = performance.now()) {
    if (!this.hello) return;
    this.history.add(frame);
    this.numMissedEvents += frame.missed_events;
    if (this.paused) {
      this.latest = frame;
      return;
    }
    if (frame.missed_events) this.addNotice(`missed ${frame.missed_events} events (the log moved on)`);
    this.addEvents(frame.events);
    this.draw(frame, receivedAt);
  }

  draw(frame, receivedAt = performance.now()) {
    this.frame = frame;
    this.states = decodeBlockStates(frame.blocks, GPU_STATE_CHARS, this.hello.num_blocks, this.states);
    this.cpuStates = decodeBlockStates(frame.cpu_blocks, CPU_STATE_CHARS, this.hello.num_cpu_blocks, this.cpuStates);
    const selected = frame.requests.find((request) => request.label === this.selectedLabel) ?? null;
    this.selectedLabel = selected?.label ?? null;
    const mapStarted = performance.now();
    this.imageBlocks = selected ? imageBlocks(selected, this.hello.block_size) : [];
    this.map.show(this.states, selected ? selected.block_tables.flat() : [], this.imageBlocks);
    if (this.cpuStates.length) this.swapMap.show(this.cpuStates);
    const mapMs = performance.now() - mapStarted;
    this.showLegend();
    this.showSlots(frame.requests);
    this.trends.draw(frame.time);
    const pressure = this.history.pressure;
    this.pressure.hidden = pressure === null;
    if (pressure) {
      this.pressure.textContent = `⚠ KV pool ${Math.round(pressure.usage * 100)}% full · ${pressure.recent} ` +
        `preemptions in ${pressure.windowS} s: requests are recomputed`;
    }
    const frameMs = performance.now() - receivedAt;
    Object.assign(this.map.canvas.dataset, { time: frame.time, numSteps: frame.num_steps });
    Object.assign(this.root.dataset, { frameMs: frameMs.toFixed(3), mapMs: mapMs.toFixed(3) });
    const switching = frame.loading ? ` · ⇄ ${describeSwitch(frame.loading)}` : "";
    // Layer groups (a model with window or recurrent layers): the map holds their pools one after the other.
    const groups = (frame.gauges.kv_groups ?? []).map((group) =>
      ` · ${group.sliding_window === null ? "full"
        : group.sliding_window === "state" ? "state" : `window ${group.sliding_window}`}: ` +
      `${formatCount(group.num_used_blocks)} used, ${formatCount(group.num_cached_blocks)} cached, ` +
      `${formatCount(group.num_free_blocks)} free`).join("");
    this.showStatus(`step ${formatCount(frame.num_steps)} · frame ${frameMs.toFixed(1)} ms${groups}${switching}`);
  }

  /** No model is loaded (a `monitor.no_model` frame): say so, and which model is on its way. */
  showNoModel(frame) {
    if (this.hello) this.addNotice(`model ${this.hello.model} unloaded`);
    this.hello = null;
    this.showStatus(`no model loaded${frame.loading ? ` · ⇄ ${describeSwitch(frame.loading)}` : ""}`);
  }

  redraw() {
    this.trends.resize();
    this.map.resize();
    if (this.cpuStates.length) this.swapMap.resize();
    if (this.frame) this.trends.draw(this.frame.time);
  }

  togglePause() {
    this.paused = !this.paused;
    this.pauseButton.textContent = this.paused ? "Resume" : "Pause";
    this.pauseButton.setAttribute("aria-pressed", String(this.paused));
    if (!this.paused && this.latest) {
      this.draw(this.latest);
      this.latest = null;
    }
  }

  showStatus(text) {
    const missed = this.numMissedEvents ? ` · missed ${this.numMissedEvents} events` : "";
    this.statusNode.textContent = `monitor: ${text}${missed}${this.paused ? " · paused" : ""}`;
  }

  showLegend() {
    const counts = countStates(this.states);
    const items = SHOWN_STATES.map((state) => el("span", { dataset: { state: STATE_NAMES[state] } },
      el("span", { class: `swatch ${STATE_CLASSES[state]}` }), `${STATE_NAMES[state]} ${formatCount(counts[state])}`));
    if (this.cpuStates.length) {
      const swapped = countStates(this.cpuStates)[SWAPPED];
      items.push(el("span", { dataset: { state: "swapped" } }, el("span", { class: `swatch ${STATE_CLASSES[SWAPPED]}` }),
        `swapped ${formatCount(swapped)}/${formatCount(this.cpuStates.length)}`));
    }
    const blocksPerCell = Number(this.map.canvas.dataset.blocksPerCell);
    items.push(el("span", { class: "dim" }, `free queue ${formatCount(counts[EMPTY] + counts[1])}` +
      (blocksPerCell > 1 ? ` · ${blocksPerCell} blocks/cell` : "")));
    if (this.selectedLabel) {
      if (this.imageBlocks.length) {
        items.push(el("span", { dataset: { state: "image" } }, el("span", { class: "swatch state-image" }),
          `image tokens ${formatCount(this.imageBlocks.length)}`));
      }
      items.push(el("span", {}, el("span", { class: "swatch state-selected" }), `${this.selectedLabel}'s blocks`));
    }
    replaceChildren(this.root.querySelector("#map-legend"), ...items);
  }

  showSlots(requests) {
    const slots = this.hello ? `/${this.hello.max_num_seqs}` : "";
    const gauges = this.frame?.gauges;
    this.root.querySelector("#slots-title").textContent = gauges
      ? `${gauges.num_requests_running}${slots} running · ${gauges.num_requests_waiting} waiting` +
        (gauges.num_requests_swapped ? ` · ${gauges.num_requests_swapped} swapped` : "") : "";
    if (!requests.length) {
      this.slotRows.clear();
      replaceChildren(this.slotsBody, el("tr", { class: "empty" }, el("td", { colspan: 9 }, "no requests")));
      return;
    }
    this.slotsBody.querySelector("tr.empty")?.remove();
    const rows = requests.map((request) => {
      let row = this.slotRows.get(request.label);
      if (!row) {
        row = el("tr", { dataset: { label: request.label } }, ...Array.from({ length: 9 }, () => el("td")));
        this.slotRows.set(request.label, row);
      }
      const prompt = request.state === "prefill"
        ? `${request.num_computed_prompt_tokens}/${request.num_prompt_tokens}` : String(request.num_prompt_tokens);
      const images = imageCount(request); // marked ▣N (the map's image glyph in the TUI), in words on hover
      const texts = [request.label, images ? `${request.state} ▣${request.image_spans.length}` : request.state, prompt, String(request.num_output_tokens), String(request.num_seqs),
        String(request.num_cached_tokens), String(request.num_preemptions), request.tokens_per_s.toFixed(1),
        String(this.countBlocks(request.block_tables))];
      texts.forEach((text, index) => {
        const cell = row.cells[index];
        if (cell.textContent !== text) cell.textContent = text;
      });
      if (images) row.cells[1].title = images;
      else row.cells[1].removeAttribute("title");
      row.classList.toggle("selected", request.label === this.selectedLabel);
      return row;
    });
    const shown = new Set(rows);
    for (const [label, row] of this.slotRows) if (!shown.has(row)) this.slotRows.delete(label);
    // Move only the rows out of place: most frames keep most requests, in the same order.
    let cursor = this.slotsBody.firstElementChild;
    for (const row of rows) {
      if (row === cursor) cursor = cursor.nextElementSibling;
      else this.slotsBody.insertBefore(row, cursor);
    }
    while (cursor) {
      const next = cursor.nextElementSibling;
      cursor.remove();
      cursor = next;
    }
  }

  /** How many distinct blocks a request's sequences hold (shared ones once). */
  countBlocks(tables) {
    if (tables.length === 1) return tables[0].length; // a block table never holds a block twice
    if (this.blockStamps?.length !== this.states.length) this.blockStamps = new Uint32Array(this.states.length);
    this.stamp = (this.stamp ?? 0) + 1;
    let count = 0;
    for (const table of tables) {
      for (const block of table) {
        if (this.blockStamps[block] !== this.stamp) {
          this.blockStamps[block] = this.stamp;
          count += 1;
        }
      }
    }
    return count;
  }

  select(label) {
    this.selectedLabel = label;
    if (this.frame) this.draw(this.frame);
  }

  addEvents(events) {
    const lines = events.filter((event) => !QUIET_EVENTS.has(event.event)).map((event) => el("li",
      { class: BAD_EVENTS.has(event.event) ? "bad" : null, dataset: { event: event.event } },
      el("span", { class: "time" }, clockTime(event.time)),
      el("span", { class: "request" }, event.request ?? "-"), describeEvent(event)));
    this.addLines(lines);
  }

  addNotice(text) {
    this.addLines([el("li", { class: "notice" }, el("span", { class: "time" }, clockTime(Date.now() / 1000)), text)]);
  }

  addLines(lines) {
    if (!lines.length) return;
    this.events.prepend(...lines.reverse()); // newest first
    while (this.events.childElementCount > MAX_EVENTS) this.events.lastElementChild.remove();
    this.root.querySelector("#events-title").textContent = `newest first · last ${MAX_EVENTS}`;
  }

  showCapacity(hello) {
    this.root.querySelector("#capacity-seqs").textContent = `seqs@${hello.max_model_len}`;
    replaceChildren(this.root.querySelector("#capacity tbody"), ...capacityRows(hello).map((row) => el("tr",
      { class: row.now ? "now" : null, dataset: { format: row.format } },
      el("td", {}, row.format), el("td", {}, formatCount(row.bytes_per_token)), el("td", {}, formatCount(row.num_tokens)),
      el("td", {}, String(Math.floor(row.num_tokens / hello.max_model_len))), el("td", {}, row.now ? "◀ now" : ""))));
    const numTokens = hello.num_blocks * hello.block_size;
    this.root.querySelector("#capacity-summary").textContent =
      `now: K ${hello.cache_type_k}, V ${hello.cache_type_v}: ${formatCount(hello.num_blocks)} blocks × ` +
      `${hello.block_size} = ${formatCount(numTokens)} tokens, ${(hello.kv_cache_bytes / 2 ** 20).toFixed(0)} MiB; ` +
      `${hello.max_num_seqs} slots, ${hello.max_num_batched_tokens} tokens a step`;
  }

  showHover(x, y) {
    const range = this.map.blocksAt(x, y);
    if (!range || !this.frame) {
      this.hover.textContent = "";
      return;
    }
    const [first, end] = range;
    const holders = this.frame.requests.filter((request) => request.block_tables.some(
      (table) => table.some((block) => block >= first && block < end))).map((request) => {
      const image = imageBlocks(request, this.hello?.block_size ?? 1).some((block) => block >= first && block < end);
      return image ? `${request.label} (image tokens)` : request.label;
    });
    const where = end - first > 1 ? `blocks ${first}-${end - 1}` : `block ${first}`;
    const state = STATE_NAMES[this.states[first]];
    this.hover.textContent = `${where}: ${state}${holders.length ? ` · ${holders.join(", ")}` : ""}`;
  }
}
