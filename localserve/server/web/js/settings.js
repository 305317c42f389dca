// The request settings (the model, the system prompt and sampling), kept in localStorage. The model picker
// lists /v1/models (each model's status beside it); an empty field sends nothing, so the server's default
// applies; the chosen model's defaults are shown as each field's placeholder.

import { el, replaceChildren } from "./dom.js";

const STORAGE_KEY = "localserve.settings";
const FIELDS = [
  { name: "system", label: "System prompt", kind: "text" },
  { name: "temperature", label: "temperature", kind: "number", min: 0, max: 2, step: 0.05 },
  { name: "top_p", label: "top_p", kind: "number", min: 0, max: 1, step: 0.01 },
  { name: "top_k", label: "top_k", kind: "number", min: 1, step: 1 },
  { name: "min_p", label: "min_p", kind: "number", min: 0, max: 1, step: 0.01 },
  { name: "max_tokens", label: "max tokens", kind: "number", min: 1, step: 1 },
];

export class Settings {
  constructor(container, storage = window.localStorage) {
    this.storage = storage;
    let stored = {};
    try {
      stored = JSON.parse(storage.getItem(STORAGE_KEY) ?? "{}") ?? {};
    } catch {
      stored = {};
    }
    this.storedModel = stored.model ?? null;
    this.models = [];
    this.onModelChange = () => {};
    this.modelPicker = el("select", { name: "model" });
    this.modelPicker.addEventListener("change", () => {
      this.persist();
      this.onModelChange(this.model);
    });
    container.append(el("label", {}, "model", this.modelPicker));
    this.inputs = {};
    for (const field of FIELDS) {
      const input = field.kind === "text"
        ? el("textarea", { name: field.name, rows: 2, placeholder: "none" })
        : el("input", { name: field.name, type: "number", min: field.min, max: field.max, step: field.step });
      input.value = stored[field.name] ?? "";
      input.addEventListener("input", () => this.persist());
      this.inputs[field.name] = input;
      container.append(el("label", { class: field.kind === "text" ? "wide" : null }, field.label, input));
    }
  }

  /** Fill the model picker from /v1/models' list (kept choice if still served, else the server's default);
   * returns the model chosen. */
  showModels(models) {
    const chosen = this.modelPicker.value || this.storedModel;
    this.models = models;
    replaceChildren(this.modelPicker, ...models.map((model) => el("option", { value: model.id },
      `${model.id} · ${model.status ?? "loaded"}`)));
    const fallback = models.find((model) => (model.names ?? []).includes("default")) ?? models[0];
    this.modelPicker.value = models.some((model) => model.id === chosen) ? chosen : fallback.id;
    return this.model;
  }

  /** The entry of the model chosen. */
  get model() {
    return this.models.find((model) => model.id === this.modelPicker.value);
  }

  /** Show the server's defaults (`sampling_defaults` of /v1/models, and the context) as placeholders. */
  showDefaults(model) {
    const defaults = model.sampling_defaults ?? {};
    for (const name of ["temperature", "top_p", "top_k", "min_p"]) {
      const value = defaults[name];
      this.inputs[name].placeholder = value === null || value === undefined ? "off" : `default ${value}`;
    }
    this.inputs.max_tokens.placeholder = "server default";
    if (model.max_model_len) this.inputs.max_tokens.max = model.max_model_len;
    else this.inputs.max_tokens.removeAttribute("max"); // not loaded yet: its context is not known
  }

  /** The fields a chat completion request gets (only those set), and the system prompt. */
  request() {
    const fields = {};
    for (const field of FIELDS) {
      const raw = this.inputs[field.name].value.trim();
      if (field.kind === "number" && raw !== "") fields[field.name] = Number(raw);
    }
    return { system: this.inputs.system.value, fields };
  }

  persist() {
    const values = Object.fromEntries(FIELDS.map((field) => [field.name, this.inputs[field.name].value]));
    values.model = this.modelPicker.value || this.storedModel;
    this.storage.setItem(STORAGE_KEY, JSON.stringify(values));
  }
}
