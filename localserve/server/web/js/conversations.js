// Conversations, kept in this browser's localStorage (never on the server). A conversation is
// {id, title, created, updated, messages: [{role, content, images, reasoning, toolCalls, stats, stopped, error}]}
// (a user message's `images`: [{url (a data URL), name, bytes}]). When the images fill the browser's storage,
// they are stored without their pixels (url null: shown as "not kept") and the rest is kept.

const STORAGE_KEY = "localserve.conversations";
const ACTIVE_KEY = "localserve.active-conversation";
const TITLE_LENGTH = 48;

/** A random id. Not crypto.randomUUID: that needs a secure context, and the page may be served over plain
 * HTTP at a LAN address. */
function newId() {
  return Array.from(crypto.getRandomValues(new Uint8Array(16)), (byte) => byte.toString(16).padStart(2, "0")).join("");
}

export class ConversationStore {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    let stored = [];
    try {
      stored = JSON.parse(storage.getItem(STORAGE_KEY) ?? "[]");
    } catch {
      stored = []; // unreadable: start over rather than fail to load the page
    }
    this.conversations = Array.isArray(stored) ? stored : [];
  }

  /** Newest first. */
  list() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  get(id) {
    return this.conversations.find((conversation) => conversation.id === id) ?? null;
  }

  create() {
    const now = Date.now();
    const conversation = { id: newId(), title: "New chat", titled: false, created: now, updated: now,
      messages: [] };
    this.conversations.push(conversation);
    this.save(conversation);
    return conversation;
  }

  /** Store `conversation` as it is now; its first user message names it until it is renamed. */
  save(conversation) {
    conversation.updated = Date.now();
    const first = conversation.messages.find((message) => message.role === "user");
    if (!conversation.titled && first) {
      const title = first.content.replace(/\s+/g, " ").trim() || (first.images?.length ? "image" : "");
      conversation.title = title.length > TITLE_LENGTH ? `${title.slice(0, TITLE_LENGTH - 1)}…` : title || "New chat";
    }
    this.persist();
  }

  rename(id, title) {
    const conversation = this.get(id);
    if (!conversation || !title.trim()) return;
    conversation.title = title.trim();
    conversation.titled = true;
    this.save(conversation);
  }

  remove(id) {
    this.conversations = this.conversations.filter((conversation) => conversation.id !== id);
    this.persist();
  }

  get activeId() {
    return this.storage.getItem(ACTIVE_KEY);
  }

  set activeId(id) {
    this.storage.setItem(ACTIVE_KEY, id);
  }

  persist() {
    try {
      this.storage.setItem(STORAGE_KEY, JSON.stringify(this.conversations));
    } catch {
      // Over the storage quota (images are big): keep everything but the images' pixels.
      this.storage.setItem(STORAGE_KEY, JSON.stringify(this.conversations,
        (key, value) => (key === "url" && typeof value === "string" && value.startsWith("data:") ? null : value)));
    }
  }
}
