// The service panel, from /readyz: state, offload mode and why, queue, and each rank with
// the caller's video it runs. /readyz is asked with the key, so where the service gives
// more detail to a key holder the panel shows it; every field is optional here.

import {call} from "./api.js";
import {$, el, clear, setText, fillList, statusClass, short} from "./dom.js";
import {VIDEOS_CHANGED, running} from "./jobs.js";

let timer = null;
let latest = 0; // only the latest call renders and re-arms the timer (one polling loop)
let lastReady = null; // the last /readyz answer: its ranks re-render when the open video changes

function badge(stateWord, detail) {
  const node = $("state-badge");
  node.className = `badge ${statusClass(stateWord)}`;
  setText(node, detail ? `${stateWord}: ${detail}` : stateWord);
}

function offloadText(mode) {
  if (!mode) return null;
  if (typeof mode !== "object") return String(mode);
  return mode.reason ? `${mode.mode} (${mode.reason})` : String(mode.mode ?? "");
}

// A key's own numbers (/readyz "yours"): the service keeps every key to its own queue.
function yourJobs(yours) {
  if (!yours || typeof yours !== "object") return null;
  const limit = (n) => (n === null || n === undefined ? "no limit" : `limit ${n}`);
  return `${yours.queued ?? 0} queued (${limit(yours.max_queued)}), `
    + `${yours.running ?? 0} running (${limit(yours.max_running)})`;
}

function renderGroups(ready) {
  const box = $("svc-groups");
  clear(box);
  const mine = running();
  const groups = Array.isArray(ready.groups) ? ready.groups : [];
  if (!groups.length) {
    box.append(el("p", {class: "muted"}, "No rank detail from the service."));
    return;
  }
  for (const group of groups) {
    const first = Number(group.first_rank) || 0;
    const size = Number(group.size) || 0;
    const ranks = el("ul", {class: "ranks"});
    for (let rank = first; rank < first + size; rank += 1) {
      const here = (v) => !ready.dp_group || v.dp_group === ready.dp_group; // this replica's ranks
      const video = mine.find((v) => v.dp_rank === rank && here(v));
      ranks.append(el("li", {dataset: {rank: String(rank)}},
        el("span", {class: "rank"}, `rank ${rank}`),
        video ? el("span", {class: "busy"},
          `your ${short(video.id)}: ${video.prompt ?? ""} (${video.progress ?? 0}%)`)
          : el("span", {class: "muted"}, "no video of yours")));
    }
    const head = [`group ${short(group.group ?? "?")}`, group.state,
      group.generation !== undefined ? `generation ${group.generation}` : null,
      group.rebuilds ? `${group.rebuilds} rebuilds` : null].filter(Boolean).join(" · ");
    box.append(el("div", {class: "group-box"},
      el("p", {class: `group-head ${statusClass(group.state)}`}, head),
      group.last_error ? el("p", {class: "err"}, `last error: ${group.last_error}`) : null,
      ranks));
  }
}

export async function refreshStatus() {
  clearTimeout(timer);
  const mine = ++latest;
  try {
    // 503 while starting, rebuilding or draining: its body is the answer too.
    const {data} = await call("readyz", {okStatus: [503]});
    if (mine !== latest) return;
    const ready = data || {};
    const word = ready.state || (ready.ready ? "ready" : "not ready");
    badge(word, ready.state === "draining" || !ready.ready ? ready.last_error : null);
    const groups = Array.isArray(ready.groups) ? ready.groups : [];
    fillList($("svc-summary"), [
      ["state", word],
      ["model", ready.model],
      ["offload", offloadText(ready.offload_mode)],
      ["scheduler", ready.scheduler],
      ["ranks", ready.dp_size === undefined ? null
        : `${ready.dp_size} DP${ready.sp_size > 1 ? ` × ${ready.sp_size} SP` : ""}`
          + ` in ${groups.length} group${groups.length === 1 ? "" : "s"}`],
      ["queued", ready.queue_depth],
      ["running (all keys)", ready.in_flight],
      ["your jobs", yourJobs(ready.yours)],
      ["requests assigned", ready.waves_run],
      ["rebuilds", ready.rebuilds],
      ["last error", ready.last_error],
    ]);
    lastReady = ready;
    renderGroups(ready);
  } catch (error) {
    if (mine !== latest) return;
    lastReady = null;
    badge("unreachable", error.message);
    clear($("svc-summary"));
    clear($("svc-groups"));
  }
  clearTimeout(timer);
  timer = setTimeout(refreshStatus, 2000);
}

document.addEventListener(VIDEOS_CHANGED, () => {
  if (lastReady) renderGroups(lastReady);
});
