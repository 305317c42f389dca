// The page's entry: the API client (with the key, when the server asks for one), the chat, the monitor.

import { ApiClient } from "./api.js";
import { KeyPrompt, KeyStore } from "./auth.js";
import { ChatView } from "./chat_view.js";
import { ConversationStore } from "./conversations.js";
import { MonitorFeed } from "./monitor_feed.js";
import { MonitorView } from "./monitor_view.js";
import { Settings } from "./settings.js";

const VIEW_KEY = "localserve.view";

function chooseView(view) {
  document.body.classList.remove("view-chat", "view-both", "view-monitor");
  document.body.classList.add(`view-${view}`);
  for (const button of document.querySelectorAll("#views button")) {
    button.setAttribute("aria-pressed", String(button.dataset.view === view));
  }
  window.localStorage.setItem(VIEW_KEY, view);
  window.dispatchEvent(new Event("resize"));
}

async function main() {
  const query = new URLSearchParams(window.location.search);
  const keyStore = new KeyStore();
  const keyPrompt = new KeyPrompt(keyStore, document.querySelector("#key-dialog"));
  const api = new ApiClient(keyStore, keyPrompt);
  const keyButton = document.querySelector("#key-button");
  keyButton.addEventListener("click", () => keyPrompt.ask("Type the API key."));

  for (const button of document.querySelectorAll("#views button")) {
    button.addEventListener("click", () => chooseView(button.dataset.view));
  }
  chooseView(query.get("view") ?? window.localStorage.getItem(VIEW_KEY) ?? "both");

  const settings = new Settings(document.querySelector("#settings-fields"));
  const chat = new ChatView({ root: document.body, api, store: new ConversationStore(), settings });
  const monitor = new MonitorView(document.querySelector("#monitor"), document.querySelector("#feed-status"));

  const showModel = (model) => {
    const context = model.max_model_len ? `context ${model.max_model_len}` : model.status;
    document.querySelector("#model-name").textContent = `${model.id} · ${context}`;
    document.title = `localserve · ${model.id}`;
    settings.showDefaults(model);
    chat.modelId = model.id;
    chat.attachments.showFor(model);
  };
  showModel(settings.showModels(await api.models()));
  keyButton.hidden = keyStore.get() === null;
  settings.onModelChange = showModel;
  // A reply may have loaded its model: read the list again (whether it takes images is known once it is loaded).
  chat.onReplyDone = () => api.models().then((models) => showModel(settings.showModels(models)), () => {});
  // The statuses change as requests load models: the picker lists them afresh whenever it is opened.
  settings.modelPicker.addEventListener("focus", async () => showModel(settings.showModels(await api.models())));

  const status = document.querySelector("#feed-status");
  const interval = query.get("interval"); // else the server's --monitor-interval
  const feed = new MonitorFeed(api, interval, {
    onHello: (hello) => monitor.showHello(hello),
    onSnapshot: (frame, receivedAt) => monitor.showSnapshot(frame, receivedAt),
    onNoModel: (frame) => monitor.showNoModel(frame),
    onStatus: (text, live) => {
      status.classList.toggle("live", live);
      status.classList.toggle("down", !live);
      monitor.showStatus(text);
    },
  });
  feed.connect();
  document.body.dataset.ready = "true";
}

main();
