// The chat: the conversations (ConversationStore), the messages of the open one, and the composer.
// Replies stream from /v1/chat/completions; Stop aborts the request, and the server frees its blocks as
// soon as the connection goes. User text is only ever set as text; replies go through renderMarkdown. A user
// message may carry images (js/attachments.js): shown as thumbnails, sent as `image_url` parts.

import { Attachments, messageContent, thumbnail } from "./attachments.js";
import { el, formatCount, replaceChildren } from "./dom.js";
import { renderMarkdown, splitReasoning } from "./markdown.js";

/** Tool call deltas (OpenAI's `delta.tool_calls`) merged into the calls so far, by index. */
export function mergeToolCalls(calls, deltas) {
  for (const delta of deltas) {
    const call = calls[delta.index ?? calls.length] ??= { id: null, name: "", arguments: "" };
    call.id = delta.id ?? call.id;
    call.name += delta.function?.name ?? "";
    call.arguments += delta.function?.arguments ?? "";
  }
}

export class ChatView {
  constructor({ root, api, store, settings }) {
    this.api = api;
    this.store = store;
    this.settings = settings;
    this.modelId = "default";
    this.list = root.querySelector("#conversation-list");
    this.messages = root.querySelector("#messages");
    this.prompt = root.querySelector("#prompt");
    this.sendButton = root.querySelector("#send");
    this.stopButton = root.querySelector("#stop");
    this.controller = null; // the request streaming now, if any
    this.pendingDraw = null;
    this.onReplyDone = () => {}; // called after each reply (the page reads /v1/models again: a model may have loaded)
    this.attachments = new Attachments(root, () => this.sentImages());
    root.querySelector("#new-chat").addEventListener("click", () => this.open(this.store.create().id));
    root.querySelector("#composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.stopButton.addEventListener("click", () => this.controller?.abort());
    const active = this.store.get(this.store.activeId) ?? this.store.list()[0] ?? this.store.create();
    this.open(active.id);
  }

  get busy() {
    return this.controller !== null;
  }

  open(id) {
    this.current = this.store.get(id);
    this.store.activeId = id;
    this.drawList();
    this.drawMessages();
    this.prompt.focus();
  }

  drawList() {
    replaceChildren(this.list, ...this.store.list().map((conversation) => el("li",
      { class: conversation.id === this.current?.id ? "active" : null, dataset: { id: conversation.id } },
      el("button", { type: "button", class: "title", title: conversation.title, onclick: () => this.open(conversation.id) },
        conversation.title),
      el("button", { type: "button", class: "small rename", title: "rename", onclick: () => this.rename(conversation) }, "✎"),
      el("button", { type: "button", class: "small delete", title: "delete", onclick: () => this.remove(conversation) }, "×"))));
  }

  rename(conversation) {
    const title = window.prompt("Rename the conversation", conversation.title);
    if (title === null) return;
    this.store.rename(conversation.id, title);
    this.drawList();
  }

  remove(conversation) {
    if (this.busy && conversation === this.current) this.controller.abort();
    this.store.remove(conversation.id);
    const next = this.store.list()[0] ?? this.store.create();
    this.open(next.id);
  }

  drawMessages() {
    const messages = this.current.messages;
    replaceChildren(this.messages, ...messages.map((message, index) => this.messageNode(message, index)));
    this.messages.scrollTop = this.messages.scrollHeight;
  }

  messageNode(message, index) {
    const node = el("div", { class: `message ${message.role}`, dataset: { index } });
    if (message.role === "user") {
      const images = message.images?.length ? [el("div", { class: "images" }, ...message.images.map(thumbnail))] : [];
      node.append(el("div", { class: "role" }, "you"), ...images, el("div", { class: "text" }, message.content),
        el("div", { class: "meta" }, el("button", { type: "button", class: "edit", disabled: this.busy,
          onclick: () => this.edit(node, index) }, "Edit")));
    } else {
      this.fillReply(node, message, index);
    }
    return node;
  }

  /** The reply's parts: reasoning (folded), tool calls, the answer as markdown, an error, its numbers. */
  fillReply(node, message, index) {
    const { reasoning, answer, thinking } = splitReasoning(message.content);
    const allReasoning = (message.reasoning ?? "") + reasoning;
    const parts = [el("div", { class: "role" }, "assistant")];
    if (allReasoning) {
      parts.push(el("details", { class: "reasoning" }, el("summary", {}, thinking ? "Reasoning…" : "Reasoning"),
        el("div", { class: "text" }, allReasoning)));
    }
    for (const call of message.toolCalls ?? []) {
      parts.push(el("div", { class: "tool-call" }, el("div", { class: "dim" }, `tool call: ${call.name || "?"}`),
        el("pre", {}, call.arguments)));
    }
    const content = el("div", { class: "content" });
    content.append(renderMarkdown(answer));
    parts.push(content);
    if (message.error) parts.push(el("div", { class: "error" }, message.error));
    const streaming = message === this.streamingReply;
    const meta = el("div", { class: "meta" });
    if (message.stats) {
      const { completionTokens, tokensPerS, cachedTokens, promptTokens } = message.stats;
      meta.append(el("span", { class: "stats", dataset: { completionTokens, cachedTokens, promptTokens } },
        `${formatCount(completionTokens)} tokens · ${tokensPerS === null ? "-" : tokensPerS.toFixed(1)} tokens/s · ` +
        `${formatCount(cachedTokens)} of ${formatCount(promptTokens)} prompt tokens cached`));
    }
    if (message.stopped) meta.append(el("span", { class: "stopped" }, "stopped"));
    if (!streaming) {
      meta.append(el("button", { type: "button", class: "copy-reply", onclick: (event) => this.copy(message, event.target) },
        "Copy"));
      if (index === this.current.messages.length - 1) {
        meta.append(el("button", { type: "button", class: "regenerate", disabled: this.busy,
          onclick: () => this.regenerate() }, "Regenerate"));
      }
    }
    parts.push(meta);
    node.classList.toggle("streaming", streaming);
    replaceChildren(node, ...parts);
  }

  async copy(message, button) {
    try {
      await navigator.clipboard.writeText(splitReasoning(message.content).answer);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
  }

  edit(node, index) {
    if (this.busy) return;
    const box = el("textarea", { class: "edit" });
    const { content, images } = this.current.messages[index];
    box.value = content;
    const resend = () => {
      const text = box.value.trim();
      if (!text && !images?.length) return;
      this.current.messages.splice(index, Infinity, { role: "user", content: text, ...(images ? { images } : {}) });
      this.store.save(this.current);
      this.generate(this.current);
    };
    replaceChildren(node, el("div", { class: "role" }, "you (editing)"), box, el("div", { class: "meta" },
      el("button", { type: "button", class: "resend", onclick: resend }, "Send"),
      el("button", { type: "button", onclick: () => this.drawMessages() }, "Cancel")));
    box.focus();
  }

  send() {
    const text = this.prompt.value.trim();
    if ((!text && !this.attachments.images.length) || this.busy) return;
    this.prompt.value = "";
    const images = this.attachments.take().map(({ url, name, bytes }) => ({ url, name, bytes }));
    this.current.messages.push({ role: "user", content: text, ...(images.length ? { images } : {}) });
    this.store.save(this.current);
    this.drawList();
    this.generate(this.current);
  }

  regenerate() {
    if (this.busy) return;
    const messages = this.current.messages;
    if (messages.at(-1)?.role === "assistant") messages.pop();
    this.generate(this.current);
  }

  /** Stream a reply to the conversation as it stands. */
  async generate(conversation) {
    const { system, fields } = this.settings.request();
    const history = conversation.messages.map((message) => ({ role: message.role,
      content: message.role === "assistant" ? splitReasoning(message.content).answer : messageContent(message) }));
    const messages = [...(system.trim() ? [{ role: "system", content: system }] : []), ...history];
    const reply = { role: "assistant", content: "", reasoning: "", toolCalls: [], stats: null, stopped: false,
      error: null };
    conversation.messages.push(reply);
    const controller = new AbortController();
    this.controller = controller;
    this.streamingReply = reply;
    this.showBusy(true);
    this.drawMessages();
    const started = performance.now();
    let firstTokenAt = null;
    let usage = null;
    try {
      for await (const chunk of this.api.streamChat({ model: this.modelId, messages, ...fields }, controller.signal)) {
        if (chunk.error) {
          reply.error = chunk.error.message;
          break;
        }
        usage = chunk.usage ?? usage;
        for (const choice of chunk.choices ?? []) {
          const delta = choice.delta ?? {};
          if (delta.content || delta.reasoning_content || delta.tool_calls) firstTokenAt ??= performance.now();
          reply.content += delta.content ?? "";
          reply.reasoning += delta.reasoning_content ?? "";
          if (delta.tool_calls) mergeToolCalls(reply.toolCalls, delta.tool_calls);
        }
        this.scheduleDraw(conversation, reply);
      }
    } catch (error) {
      if (error.name === "AbortError") reply.stopped = true;
      else reply.error = error.message;
    }
    const ended = performance.now();
    if (usage) {
      const completionTokens = usage.completion_tokens;
      const decodeS = firstTokenAt === null ? 0 : (ended - firstTokenAt) / 1000;
      reply.stats = { completionTokens, promptTokens: usage.prompt_tokens,
        cachedTokens: usage.prompt_tokens_details?.cached_tokens ?? 0,
        tokensPerS: completionTokens > 1 && decodeS > 0 ? (completionTokens - 1) / decodeS : null,
        firstTokenMs: firstTokenAt === null ? null : firstTokenAt - started };
    }
    this.controller = null;
    this.streamingReply = null;
    this.store.save(conversation);
    this.showBusy(false);
    if (conversation === this.current) this.drawMessages();
    this.drawList();
    this.onReplyDone();
  }

  /** How many images the open conversation sends with its next message already, and their bytes. */
  sentImages() {
    const images = (this.current?.messages ?? []).flatMap((message) => message.images ?? []);
    return { count: images.length, bytes: images.reduce((sum, image) => sum + (image.bytes ?? 0), 0) };
  }

  /** Redraw the streaming reply at most once a frame, however fast chunks come. */
  scheduleDraw(conversation, reply) {
    if (this.pendingDraw !== null) return;
    this.pendingDraw = requestAnimationFrame(() => {
      this.pendingDraw = null;
      if (conversation !== this.current || reply !== this.streamingReply) return;
      const node = this.messages.lastElementChild;
      if (node) this.fillReply(node, reply, conversation.messages.length - 1);
      this.messages.scrollTop = this.messages.scrollHeight;
    });
  }

  showBusy(busy) {
    this.sendButton.disabled = busy;
    this.stopButton.hidden = !busy;
  }
}
