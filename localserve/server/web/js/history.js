// Time series derived from successive monitor snapshots, over minutes (mirrors tui/history.py).
//
// Gauges are values now; rates (tokens/s, preemptions/s, the prefix hit rate) come from the difference of
// two snapshots over the server's own clock (`snapshot.time`), never across a reconnection or a restarted
// server. The step time is the last step's only when a step ran since the previous snapshot: an idle
// engine's samples are idle (null), not the last step repeated.

export const WINDOW_S = 300; // what the trends show: the last five minutes
export const SERIES = ["kv_usage", "running", "waiting", "preemptions_per_s", "prefix_hit_rate", "tokens_per_s",
  "step_ms"];
export const PINNED_USAGE = 0.95; // a pool this full has no room for the next block of a running request
export const PRESSURE_WINDOW_S = 5.0; // preemptions this recent, with the pool pinned, mean it thrashes

export class FeedHistory {
  constructor(windowS = WINDOW_S) {
    this.windowS = windowS;
    this.series = Object.fromEntries(SERIES.map((name) => [name, []])); // [{time, value}], oldest first
    this.previous = null;
    this.preemptionTimes = []; // [time, num_preemptions] within the pressure window
    this.pressure = null;
  }

  newBaseline() {
    this.previous = null;
    this.preemptionTimes = [];
  }

  add(snapshot) {
    const { gauges, counters, time } = snapshot;
    let previous = this.previous;
    if (previous && (time <= previous.time || counters.num_preemptions < previous.counters.num_preemptions)) {
      previous = null; // the clock or the counters went back: a restarted server, no rate across it
      this.preemptionTimes = [];
    }
    this.push("kv_usage", time, gauges.kv_cache_usage_ratio);
    this.push("running", time, gauges.num_requests_running);
    this.push("waiting", time, gauges.num_requests_waiting);
    if (previous) {
      const elapsed = time - previous.time;
      const before = previous.counters;
      this.push("step_ms", time, snapshot.num_steps > previous.num_steps ? gauges.last_step_s * 1000 : null);
      this.push("preemptions_per_s", time, (counters.num_preemptions - before.num_preemptions) / elapsed);
      this.push("tokens_per_s", time, (counters.num_generation_tokens - before.num_generation_tokens) / elapsed);
      const queried = counters.prefix_query_tokens - before.prefix_query_tokens;
      if (queried > 0) this.push("prefix_hit_rate", time, (counters.prefix_hit_tokens - before.prefix_hit_tokens) / queried);
    }
    this.previous = { time, num_steps: snapshot.num_steps, counters };
    this.updatePressure(time, counters.num_preemptions, gauges.kv_cache_usage_ratio);
  }

  push(name, time, value) {
    const samples = this.series[name];
    samples.push({ time, value });
    let drop = 0;
    while (drop < samples.length && samples[drop].time < time - this.windowS) drop += 1;
    if (drop) samples.splice(0, drop);
  }

  /** The newest sample of a series ({time, value}, value null when idle), or null before it has one. */
  latest(name) {
    const samples = this.series[name];
    return samples.length ? samples[samples.length - 1] : null;
  }

  /**
   * The window ending at `endTime` cut into `count` equal bins: each the mean of the series' values in
   * it, or null where it has none (no sample, or only idle ones).
   */
  bins(name, count, endTime) {
    const sums = new Float64Array(count);
    const numbers = new Uint32Array(count);
    const start = endTime - this.windowS;
    for (const { time, value } of this.series[name]) {
      if (value === null || time <= start || time > endTime) continue;
      const bin = Math.min(count - 1, Math.floor(((time - start) / this.windowS) * count));
      sums[bin] += value;
      numbers[bin] += 1;
    }
    return Array.from(sums, (sum, bin) => (numbers[bin] ? sum / numbers[bin] : null));
  }

  updatePressure(time, numPreemptions, usage) {
    const times = this.preemptionTimes;
    times.push([time, numPreemptions]);
    while (times.length > 1 && times[1][0] <= time - PRESSURE_WINDOW_S) times.shift();
    const recent = times[times.length - 1][1] - times[0][1];
    this.pressure = usage >= PINNED_USAGE && recent > 0 ? { usage, recent, windowS: PRESSURE_WINDOW_S } : null;
  }
}
