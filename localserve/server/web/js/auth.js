// The API key, asked for when the server answers 401, kept for this tab only (sessionStorage).

const STORAGE_KEY = "localserve.api-key";

export class KeyStore {
  constructor(storage = window.sessionStorage) {
    this.storage = storage;
  }

  get() {
    return this.storage.getItem(STORAGE_KEY);
  }

  set(key) {
    if (key) this.storage.setItem(STORAGE_KEY, key);
    else this.storage.removeItem(STORAGE_KEY);
  }
}

/** Shows the key dialog; resolves once a key is typed (one dialog at a time however many ask). */
export class KeyPrompt {
  constructor(keyStore, dialog) {
    this.keyStore = keyStore;
    this.dialog = dialog;
    this.form = dialog.querySelector("form");
    this.input = dialog.querySelector("input");
    this.message = dialog.querySelector("#key-message");
    this.pending = null;
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      const key = this.input.value.trim();
      if (!key) return;
      this.keyStore.set(key);
      this.input.value = "";
      this.dialog.close();
      const resolve = this.pending?.resolve;
      this.pending = null;
      resolve?.();
    });
    this.dialog.addEventListener("cancel", (event) => event.preventDefault()); // nothing works without it
  }

  ask(reason) {
    if (!this.pending) {
      let resolve;
      const promise = new Promise((done) => { resolve = done; });
      this.pending = { promise, resolve };
      this.message.textContent = reason;
      this.dialog.showModal();
      this.input.focus();
    }
    return this.pending.promise;
  }
}
