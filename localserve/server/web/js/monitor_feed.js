// A reconnecting reader of /v1/monitor. Each connection first takes a single-use ticket from
// POST /v1/monitor/ticket (with the API key, when there is one: a browser cannot put it on a websocket),
// then opens the socket on this page's own host with that ticket. When the socket closes or cannot be
// opened it tries again, waiting longer each time (up to MAX_DELAY_MS), and from the first delay after a
// good connection.

const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 8000;

export class MonitorFeed {
  /** `handlers`: onHello(frame) (again when the server's model changes), onSnapshot(frame, receivedAt),
   * onNoModel(frame) (no model loaded), onStatus(text, live). */
  constructor(api, intervalS, handlers) {
    this.api = api;
    this.intervalS = intervalS;
    this.handlers = handlers;
    this.delayMs = FIRST_DELAY_MS;
    this.socket = null;
  }

  async connect() {
    let ticket;
    try {
      ticket = await this.api.monitorTicket();
    } catch (error) {
      this.retry(`no ticket: ${error.message}`);
      return;
    }
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const query = new URLSearchParams(this.intervalS ? { interval: String(this.intervalS), ticket } : { ticket });
    const socket = new WebSocket(`${scheme}//${window.location.host}/v1/monitor?${query}`);
    this.socket = socket;
    socket.addEventListener("message", (message) => {
      const receivedAt = performance.now();
      const frame = JSON.parse(message.data);
      if (frame.type === "monitor.hello") {
        this.delayMs = FIRST_DELAY_MS;
        this.handlers.onStatus("live", true);
        this.handlers.onHello(frame);
      } else if (frame.type === "monitor.snapshot") {
        this.handlers.onSnapshot(frame, receivedAt);
      } else if (frame.type === "monitor.no_model") {
        this.delayMs = FIRST_DELAY_MS;
        this.handlers.onNoModel(frame);
      }
    });
    socket.addEventListener("close", (event) => this.retry(event.reason || `closed (${event.code})`));
  }

  retry(reason) {
    const seconds = (this.delayMs / 1000).toFixed(1);
    this.handlers.onStatus(`reconnecting in ${seconds} s (${reason})`, false);
    setTimeout(() => this.connect(), this.delayMs);
    this.delayMs = Math.min(MAX_DELAY_MS, this.delayMs * 2);
  }
}

/** What a model switch (a frame's `loading`) is doing, in a few words (tui/feed.py's ModelSwitch.describe). */
export function describeSwitch(loading) {
  if (loading.phase === "loading") return `loading ${loading.model} (${Math.round(loading.elapsed_s)} s)`;
  if (loading.phase === "unloading") return `unloading ${loading.unloading} for ${loading.model}`;
  return `${loading.model} waits for ${loading.unloading ? `${loading.unloading}'s requests to finish` : "room"}`;
}
