// Building the page's elements. Text always goes in as text nodes (never as HTML): `el` appends strings
// with Node.append, which makes text nodes, and sets attributes with setAttribute.

/** An element with attributes (`class`, `dataset`, `on<event>` listeners, others as attributes) and children. */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children.filter((child) => child !== null && child !== undefined && child !== false));
  return node;
}

/** `node`'s children replaced by `children` (strings become text nodes). */
export function replaceChildren(node, ...children) {
  node.replaceChildren(...children.filter((child) => child !== null && child !== undefined && child !== false));
}

/** A number with thousands separators. */
export function formatCount(value) {
  return Number(value).toLocaleString("en-US");
}

/** A time of day with milliseconds, as the TUI's event log writes it. */
export function clockTime(epochSeconds) {
  const date = new Date(epochSeconds * 1000);
  const pad = (value, width = 2) => String(value).padStart(width, "0");
  return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}.${pad(date.getMilliseconds(), 3)}`;
}
