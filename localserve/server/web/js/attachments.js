// Images attached to the next message: picked with the attach button (a file picker), dropped on the composer
// or pasted into the message box. Each is read as a data URL (the form OpenAI's `image_url` parts take, and the
// one the Content-Security-Policy lets an <img> show), shown as a removable thumbnail until the message is sent,
// and checked here (its type, size and pixels, and that the browser can read it as a picture) against the
// server's default bounds (server/request/images.py ImageBounds) so a file the
// server would refuse is refused at once with a clear message; a server started with other bounds still
// answers a 400, which the conversation shows.

import { el, replaceChildren } from "./dom.js";

export const IMAGE_TYPES = { "image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WebP", "image/gif": "GIF" };
export const MAX_IMAGE_BYTES = 10 * 2 ** 20; // one image's file (--max-image-bytes)
export const MAX_REQUEST_IMAGE_BYTES = 20 * 2 ** 20; // every image of a request together (--max-request-image-bytes)
export const MAX_IMAGES = 16; // images in one request (--max-images)
export const MAX_IMAGE_PIXELS = 2 ** 25; // width x height of one image (--max-image-pixels)

const MIB = 2 ** 20;

function mebibytes(bytes) {
  return `${(bytes / MIB).toFixed(1)} MiB`;
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error ?? new Error("the file could not be read"));
    reader.readAsDataURL(file);
  });
}

/** The picture's width and height as the browser reads them, or an error when it cannot read it as an image. */
function pictureSize(url) {
  return new Promise((resolve, reject) => {
    const image = new Image();
    image.onload = () => resolve([image.naturalWidth, image.naturalHeight]);
    image.onerror = () => reject(new Error("it is not a picture the browser can read"));
    image.src = url;
  });
}

/** Why a picture of `width` x `height` cannot go, or null. */
export function pixelRefusal(name, width, height) {
  if (width * height <= MAX_IMAGE_PIXELS) return null;
  return `"${name}" is ${width}×${height} pixels: an image may have ${MAX_IMAGE_PIXELS.toLocaleString("en-US")} pixels at most`;
}

/** Why `file` cannot go with a request that already carries `count` images of `bytes` bytes, or null. */
export function refusal(file, count, bytes) {
  const name = file.name || "the pasted image";
  if (!(file.type in IMAGE_TYPES)) {
    return `"${name}" is ${file.type || "not an image"}: the server takes ${Object.values(IMAGE_TYPES).join(", ")} images`;
  }
  if (file.size > MAX_IMAGE_BYTES) return `"${name}" is ${mebibytes(file.size)}: an image may be ${mebibytes(MAX_IMAGE_BYTES)} at most`;
  if (count + 1 > MAX_IMAGES) return `"${name}" would be image ${count + 1}: a request may carry ${MAX_IMAGES} images at most`;
  if (bytes + file.size > MAX_REQUEST_IMAGE_BYTES) {
    return `"${name}" would make the request's images ${mebibytes(bytes + file.size)}: ${mebibytes(MAX_REQUEST_IMAGE_BYTES)} at most together`;
  }
  return null;
}

export class Attachments {
  /** `root`: the page; `sent()`: {count, bytes} of the images the open conversation sends already. */
  constructor(root, sent) {
    this.sent = sent;
    this.images = []; // {url, name, type, bytes}
    this.takesImages = false;
    this.refusedWhy = "the model is not known yet";
    this.adding = Promise.resolve(); // files are read one batch after another: each checked against those before
    this.button = root.querySelector("#attach");
    this.input = root.querySelector("#attach-input");
    this.list = root.querySelector("#attachments");
    this.errorNode = root.querySelector("#attach-error");
    this.prompt = root.querySelector("#prompt");
    this.button.addEventListener("click", () => this.input.click());
    this.input.addEventListener("change", async () => {
      const files = [...this.input.files];
      this.input.value = ""; // the same file can be picked again
      await this.add(files);
    });
    const composer = root.querySelector("#composer");
    composer.addEventListener("dragover", (event) => {
      if (!event.dataTransfer?.types.includes("Files")) return;
      event.preventDefault();
      composer.classList.add("dropping");
    });
    composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
    composer.addEventListener("drop", (event) => {
      composer.classList.remove("dropping");
      const files = [...(event.dataTransfer?.files ?? [])];
      if (!files.length) return;
      event.preventDefault();
      this.add(files);
    });
    this.prompt.addEventListener("paste", (event) => {
      const files = [...(event.clipboardData?.files ?? [])].filter((file) => file.type.startsWith("image/"));
      if (!files.length) return; // text: pasted as usual
      event.preventDefault();
      this.add(files);
    });
    this.draw();
  }

  /** Show the attach button when the chosen model takes images (/v1/models `takes_images`: null while it is not
   * loaded, when that is not known yet). */
  showFor(model) {
    this.takesImages = model?.takes_images === true;
    this.refusedWhy = model?.takes_images === false ? `${model.id} does not take images: pick a model that does (Settings)`
      : `${model?.id ?? "the model"} is not loaded yet, so whether it takes images is not known: send a message to load it`;
    this.button.hidden = !this.takesImages;
  }

  /** Read `files` in (after any batch still being read), each checked; the first refusal is shown, the files
   * before it kept. */
  add(files) {
    this.adding = this.adding.then(() => this.read(files)).catch((error) => this.showError(error.message));
    return this.adding;
  }

  async read(files) {
    this.showError(null);
    if (!this.takesImages) {
      this.showError(this.refusedWhy);
      return;
    }
    for (const file of files) {
      const { count, bytes } = this.total();
      const why = refusal(file, count, bytes);
      if (why) {
        this.showError(why);
        break;
      }
      const name = file.name || "pasted image";
      try {
        const url = await readDataUrl(file);
        const tooLarge = pixelRefusal(name, ...await pictureSize(url));
        if (tooLarge) {
          this.showError(tooLarge);
          break;
        }
        this.images.push({ url, name, type: file.type, bytes: file.size });
      } catch (error) {
        this.showError(`"${name}" could not be read: ${error.message}`);
        break;
      }
      this.draw();
    }
  }

  /** The images of the request the next message makes: the conversation's and these. */
  total() {
    const sent = this.sent();
    return { count: sent.count + this.images.length,
      bytes: sent.bytes + this.images.reduce((sum, image) => sum + image.bytes, 0) };
  }

  remove(index) {
    this.images.splice(index, 1);
    this.showError(null);
    this.draw();
  }

  /** The attached images, handed over (the composer is cleared). */
  take() {
    const images = this.images;
    this.images = [];
    this.showError(null);
    this.draw();
    return images;
  }

  showError(text) {
    this.errorNode.hidden = !text;
    this.errorNode.textContent = text ?? "";
  }

  draw() {
    replaceChildren(this.list, ...this.images.map((image, index) => el("figure", { class: "attachment" },
      el("img", { src: image.url, alt: image.name, title: image.name }),
      el("button", { type: "button", class: "remove", title: `remove ${image.name}`, onclick: () => this.remove(index) },
        "×"))));
  }
}

/** An image of a sent message as its thumbnail in the conversation (an image the browser could not keep:
 * a note). */
export function thumbnail(image) {
  if (!image.url) return el("span", { class: "attachment dropped dim" }, `${image.name} (not kept: browser storage full)`);
  return el("img", { class: "attachment", src: image.url, alt: image.name, title: image.name });
}

/** A user message's content as the chat API takes it: its text, or its text and `image_url` parts. */
export function messageContent(message) {
  const images = (message.images ?? []).filter((image) => image.url);
  if (!images.length) return message.content;
  const parts = message.content ? [{ type: "text", text: message.content }] : [];
  return [...parts, ...images.map((image) => ({ type: "image_url", image_url: { url: image.url } }))];
}
