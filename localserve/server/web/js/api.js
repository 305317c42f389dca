// The server's HTTP API as the page uses it: the model, chat completions streamed as server-sent events,
// and tickets for the monitor websocket. Every request carries the API key as a bearer token when there is
// one; a 401 asks for the key (KeyPrompt) and tries again.

import { SseParser } from "./sse.js";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: the status says it all
  }
  const error = body?.error ?? {};
  return new ApiError(response.status, error.code ?? null, error.message ?? `${response.status} ${response.statusText}`);
}

export class ApiClient {
  constructor(keyStore, keyPrompt) {
    this.keyStore = keyStore;
    this.keyPrompt = keyPrompt;
  }

  headers(json) {
    const headers = json ? { "Content-Type": "application/json" } : {};
    const key = this.keyStore.get();
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  /** A fetch that asks for the key and repeats itself while the server answers 401. */
  async fetch(path, { method = "GET", body, signal } = {}) {
    for (;;) {
      const response = await fetch(path, {
        method, signal, headers: this.headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store",
      });
      if (response.status !== 401) return response;
      const refusedKey = this.keyStore.get();
      this.keyStore.set(null);
      await this.keyPrompt.ask(refusedKey ? "That key was refused: type it again."
        : "This server needs an API key.");
    }
  }

  async json(path, options) {
    const response = await this.fetch(path, options);
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  /** Every model /v1/models lists (id, status, names, max_model_len: null until loaded, sampling_defaults). */
  async models() {
    return (await this.json("/v1/models")).data;
  }

  /** A single-use ticket that opens one /v1/monitor websocket (the key cannot travel on a websocket). */
  async monitorTicket() {
    return (await this.json("/v1/monitor/ticket", { method: "POST", body: {} })).ticket;
  }

  /** The chunks of a streamed chat completion, as they arrive; `signal` aborts it (the server frees its blocks). */
  async *streamChat(body, signal) {
    const response = await this.fetch("/v1/chat/completions", {
      method: "POST", signal, body: { ...body, stream: true, stream_options: { include_usage: true } },
    });
    if (!response.ok) throw await errorOf(response);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SseParser();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      for (const data of parser.push(value)) {
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
