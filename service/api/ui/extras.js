// The create form's adapters (the caller's registered LoRAs, GET /v1/loras) and step cache:
// what the body sends as `loras` and `cache`, what a remix restores, where their errors go.

import {call} from "./api.js";
import {$, clear, el, setText} from "./dom.js";

let maxLoras = 0;
let generation = 0; // a list answered for an earlier key (or an earlier load) is dropped

/** The cache methods and the adapter limit this instance's schema states. */
export function readRules(props) {
  const loras = props.loras || {};
  maxLoras = typeof loras.maxItems === "number" ? loras.maxItems : 0;
  // the object branch of "CacheUse | None" (the create body's schema is inlined)
  const cache = ((props.cache || {}).anyOf || []).find((v) => v.type !== "null") || {};
  const methods = ((cache.properties || {}).method || {}).enum;
  $("field-cache").hidden = !Array.isArray(methods);
  for (const option of $("f-cache").options) {
    if (option.value) option.hidden = !(methods || []).includes(option.value);
  }
  setText($("hint-cache"), "Skipped blocks skip their weight transfers too.");
  showThreshold();
}

/** The threshold belongs to the first-block cache only. */
export function showThreshold() {
  $("field-cache_threshold").hidden = $("f-cache").value !== "first_block";
}

/** The caller's adapters (an API key sees its own and the server's), one row each. */
export async function loadAdapters() {
  const list = $("lora-list");
  const mine = ++generation;
  let data = [];
  try {
    for (let after = null, more = true; more;) { // the list comes a page at a time
      const {data: page} = await call(after ? `v1/loras?after=${encodeURIComponent(after)}` : "v1/loras");
      data = data.concat(page.data || []);
      more = Boolean(page.has_more && page.last_id);
      after = page.last_id;
    }
  } catch (error) {
    if (mine !== generation) return;
    clear(list);
    if (error.status !== 401) setText($("hint-loras"), `Could not list the adapters: ${error.message}`);
    return;
  }
  if (mine !== generation) return;
  const keep = asked();
  clear(list);
  data.forEach((entry, i) => {
    const row = el("div", {class: "lora-row", dataset: {name: entry.name}},
      el("input", {type: "checkbox", id: `lora-use-${i}`, class: "lora-use"}),
      el("label", {for: `lora-use-${i}`, class: "lora-name"}, entry.name),
      el("label", {for: `lora-scale-${i}`, class: "lora-scale-label"}, "scale"),
      el("input", {type: "number", id: `lora-scale-${i}`, class: "lora-scale", step: "any",
        inputmode: "decimal", value: "1"}));
    list.append(row);
  });
  setChecked(keep);
  const limit = maxLoras ? ` Up to ${maxLoras}, applied in the order listed.` : "";
  setText($("hint-loras"), data.length ? `Optional.${limit}`
    : "None registered for this key: POST /v1/loras, or start the service with --lora NAME=PATH.");
}

export function clearAdapters() {
  generation += 1;
  clear($("lora-list"));
}

/** [{name, scale}] of the ticked rows, in list order. */
function asked() {
  const out = [];
  for (const row of $("lora-list").children) {
    if (!row.querySelector(".lora-use").checked) continue;
    const raw = row.querySelector(".lora-scale").value; // a number input: "" or a number
    out.push({name: row.dataset.name, scale: raw === "" ? 1 : Number(raw)});
  }
  return out;
}

function setChecked(loras) {
  const want = new Map((loras || []).map((u) => [u.name, u.scale]));
  for (const row of $("lora-list").children) {
    const on = want.has(row.dataset.name);
    row.querySelector(".lora-use").checked = on;
    row.querySelector(".lora-scale").value = on && want.get(row.dataset.name) !== undefined
      ? String(want.get(row.dataset.name)) : "1";
  }
}

/** Add `loras` and `cache` to a form body (each one JSON part, as the API reads a form). */
export function addTo(body) {
  const loras = asked();
  if (loras.length) body.append("loras", JSON.stringify(loras));
  const method = $("field-cache").hidden ? "" : $("f-cache").value;
  if (method) {
    const cache = {method};
    const raw = $("f-cache_threshold").value; // a number input: "" or a number
    if (method === "first_block" && raw !== "") cache.threshold = Number(raw);
    body.append("cache", JSON.stringify(cache));
  }
}

/** Refill from a video: the adapters still registered are ticked; a missing one is said. */
export function remix(video) {
  const loras = video.loras || [];
  setChecked(loras);
  const have = new Set([...$("lora-list").children].map((row) => row.dataset.name));
  const gone = loras.map((u) => u.name).filter((name) => !have.has(name));
  setText($("err-loras"), gone.length ? `No longer registered: ${gone.join(", ")}` : "");
  const cache = video.cache || null;
  $("f-cache").value = cache && [...$("f-cache").options].some((o) => o.value === cache.method && !o.hidden)
    ? cache.method : "";
  $("f-cache_threshold").value = cache && cache.threshold != null ? String(cache.threshold) : "";
  showThreshold();
}

/** Where a server error about these fields is shown, and what takes the focus. */
export function errorTarget(param) {
  if (typeof param !== "string") return null;
  if (param === "loras" || param.startsWith("loras.")) {
    // loras.N.field: the Nth adapter sent, i.e. the Nth ticked row
    const [, index, field] = param.split(".");
    const ticked = [...$("lora-list").children].filter((row) => row.querySelector(".lora-use").checked);
    const row = ticked[Number(index)] || ticked[0] || $("lora-list").firstElementChild;
    const input = row ? row.querySelector(field === "scale" ? ".lora-scale" : ".lora-use") : null;
    return {err: "err-loras", focus: input ? input.id : null};
  }
  if (param === "cache" || param.startsWith("cache.")) {
    return {err: "err-cache", focus: param === "cache.threshold" ? "f-cache_threshold" : "f-cache"};
  }
  return null;
}
