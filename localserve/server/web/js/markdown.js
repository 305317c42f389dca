// Model output as markdown, made safe: the one way a reply reaches the page as anything but plain text.
//
// marked turns the text into HTML with raw HTML escaped (a reply holding `<img src=x onerror=...>` or
// `<script>` shows those characters and nothing else) and images shown as links (a reply cannot make the
// page fetch anything); DOMPurify then sanitizes the result into a DocumentFragment (a second fence: no
// script, handler, style or javascript: URL survives); highlight.js colours fenced code from its text,
// and each block gets a copy button. Reasoning (`<think>...</think>` at the start) is split off first.

import DOMPurify from "../vendor/dompurify/purify.es.mjs";
import hljs from "../vendor/highlight/core.min.js";
import bash from "../vendor/highlight/languages/bash.min.js";
import c from "../vendor/highlight/languages/c.min.js";
import cpp from "../vendor/highlight/languages/cpp.min.js";
import css from "../vendor/highlight/languages/css.min.js";
import go from "../vendor/highlight/languages/go.min.js";
import java from "../vendor/highlight/languages/java.min.js";
import javascript from "../vendor/highlight/languages/javascript.min.js";
import json from "../vendor/highlight/languages/json.min.js";
import markdownLanguage from "../vendor/highlight/languages/markdown.min.js";
import python from "../vendor/highlight/languages/python.min.js";
import rust from "../vendor/highlight/languages/rust.min.js";
import shell from "../vendor/highlight/languages/shell.min.js";
import sql from "../vendor/highlight/languages/sql.min.js";
import typescript from "../vendor/highlight/languages/typescript.min.js";
import xml from "../vendor/highlight/languages/xml.min.js";
import yaml from "../vendor/highlight/languages/yaml.min.js";
import { Marked } from "../vendor/marked/marked.esm.js";
import { el } from "./dom.js";

const GRAMMARS = { bash, c, cpp, css, go, java, javascript, json, markdown: markdownLanguage, python, rust, shell, sql,
  typescript, xml, yaml };
for (const [name, grammar] of Object.entries(GRAMMARS)) hljs.registerLanguage(name, grammar);
hljs.configure({ ignoreUnescapedHTML: true });

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (text) => String(text).replace(/[&<>"']/g, (char) => ESCAPES[char]);

const marked = new Marked({
  gfm: true,
  renderer: {
    html({ text }) { return escapeHtml(text); }, // raw HTML is text in a reply
    image({ href, text }) { return `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`; },
  },
});

const PURIFY = {
  RETURN_DOM_FRAGMENT: true,
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "input", "button", "textarea", "select", "iframe", "video",
    "audio", "picture", "source"],
  FORBID_ATTR: ["style", "srcset", "action", "formaction"],
};
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** `text` as markdown: a sanitized DocumentFragment, code highlighted and copyable. */
export function renderMarkdown(text) {
  const fragment = DOMPurify.sanitize(marked.parse(text), PURIFY);
  for (const code of fragment.querySelectorAll("pre > code")) {
    const language = [...code.classList].find((name) => name.startsWith("language-"))?.slice(9);
    if (language && hljs.getLanguage(language)) {
      code.replaceChildren(...DOMPurify.sanitize(hljs.highlight(code.textContent, { language }).value, PURIFY).childNodes);
      code.classList.add("hljs");
    }
    const copy = el("button", { type: "button", class: "copy", title: "copy the code" }, "Copy");
    copy.addEventListener("click", () => copyText(code.textContent, copy));
    code.parentElement.append(copy);
  }
  return fragment;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

/**
 * A reply split into its reasoning and its answer: text between a leading `<think>` and `</think>` is
 * reasoning (all of it while `</think>` has not come yet); the rest is the answer.
 */
export function splitReasoning(content) {
  const match = /^\s*<think>/.exec(content);
  if (!match) return { reasoning: "", answer: content, thinking: false };
  const rest = content.slice(match[0].length);
  const end = rest.indexOf("</think>");
  if (end < 0) return { reasoning: rest, answer: "", thinking: true };
  return { reasoning: rest.slice(0, end), answer: rest.slice(end + "</think>".length).replace(/^\s+/, ""), thinking: false };
}
