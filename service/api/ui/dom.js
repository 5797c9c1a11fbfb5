// DOM helpers. Everything the page shows from the service goes through textContent or
// attributes set one by one: no HTML string is ever parsed, so a prompt stays text.

export const $ = (id) => document.getElementById(id);

/** el("li", {class: "x", dataset: {id}}, "text", child) -> an element; strings become text nodes. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "hidden") node.hidden = true;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node) {
  while (node.firstChild) node.firstChild.remove();
}

export function setText(node, text) {
  node.textContent = text === undefined || text === null ? "" : String(text);
}

/** A <dl> filled with [term, value] pairs (values that are null are left out). */
export function fillList(dl, pairs) {
  clear(dl);
  for (const [term, value] of pairs) {
    if (value === undefined || value === null || value === "") continue;
    dl.append(el("dt", {}, term), el("dd", {}, value instanceof Node ? value : String(value)));
  }
}

/** The class for a status word, from a fixed list (a new status still renders, plainly). */
const KNOWN = new Set(["queued", "in_progress", "completed", "failed", "cancelled", "ready", "degraded",
  "rebuilding", "starting", "broken", "draining", "new", "closed", "unreachable"]);
export const statusClass = (word) => `s-${KNOWN.has(word) ? word : "other"}`;

export function when(seconds) {
  if (typeof seconds !== "number") return null;
  return new Date(seconds * 1000).toLocaleString();
}

export function short(id) {
  return typeof id === "string" && id.length > 18 ? `${id.slice(0, 14)}…` : id;
}
