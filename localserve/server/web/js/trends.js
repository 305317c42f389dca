// The trends: one row per series of a FeedHistory (history.js), a label, a chart of the last WINDOW_S
// seconds (one bin per canvas pixel column, the mean of its samples; nothing drawn where there is none)
// and the value now. The TUI's series, labels and colours (tui/trends.py).

import { el } from "./dom.js";

const TRENDS = [
  { series: "kv_usage", label: "KV usage", fullScale: 1, format: (v) => `${Math.round(v * 100)}%`, colour: "#5faf5f" },
  { series: "running", label: "running", fullScale: null, format: (v) => v.toFixed(0), colour: "#5fafff" },
  { series: "waiting", label: "waiting", fullScale: null, format: (v) => v.toFixed(0), colour: "#d7af5f" },
  { series: "preemptions_per_s", label: "preempt/s", fullScale: null, format: (v) => v.toFixed(1), colour: "#ff5f5f" },
  { series: "prefix_hit_rate", label: "prefix hits", fullScale: 1, format: (v) => `${Math.round(v * 100)}%`,
    colour: "#5f87d7" },
  { series: "tokens_per_s", label: "tokens/s", fullScale: null, format: (v) => v.toFixed(0), colour: "#87d787" },
  { series: "step_ms", label: "step", fullScale: null, format: (v) => `${v.toFixed(1)} ms`, colour: "#afafaf",
    idle: "idle" },
];

export class Trends {
  constructor(container, history) {
    this.history = history;
    this.rows = TRENDS.map((spec) => {
      const canvas = el("canvas", { height: 28, width: 300, dataset: { series: spec.series } });
      const value = el("span", { class: "value", dataset: { series: spec.series } }, "-");
      container.append(el("div", { class: "trend" }, el("span", {}, spec.label), canvas, value));
      return { spec, canvas, value };
    });
  }

  /** Fit each chart's bitmap to its size on screen (call when that changes: reading it forces a layout). */
  resize() {
    const ratio = window.devicePixelRatio || 1;
    for (const { canvas } of this.rows) {
      const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
      const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
      if (canvas.width !== width || canvas.height !== height) Object.assign(canvas, { width, height });
    }
  }

  /** Redraw every chart for the window that ends at `endTime` (the latest snapshot's time). */
  draw(endTime) {
    for (const { spec, canvas, value } of this.rows) {
      const { width, height } = canvas;
      const bins = this.history.bins(spec.series, width, endTime);
      const top = spec.fullScale ?? Math.max(0, ...bins.filter((bin) => bin !== null));
      const context = canvas.getContext("2d");
      context.clearRect(0, 0, width, height);
      context.fillStyle = "#262626";
      context.fillRect(0, height - 1, width, 1);
      context.fillStyle = spec.colour;
      bins.forEach((bin, x) => {
        if (bin === null) return;
        const barHeight = top > 0 ? Math.max(1, Math.round((Math.min(bin, top) / top) * (height - 1))) : 1;
        context.fillRect(x, height - barHeight, 1, barHeight);
      });
      const latest = this.history.latest(spec.series);
      const text = latest === null ? "-" : latest.value === null ? spec.idle : spec.format(latest.value);
      if (value.textContent !== text) value.textContent = text;
    }
  }
}
