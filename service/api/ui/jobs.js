// The open video (live progress, player, download, remix, delete) and the list of the
// caller's videos, newest first, paged with the API's `after` cursor.

import {call} from "./api.js";
import {$, el, clear, setText, fillList, statusClass, when, short} from "./dom.js";
import {remix} from "./form.js";
import {clearPreview, refreshPreview} from "./preview.js";

const UNFINISHED = new Set(["queued", "in_progress"]);
/** Fired on document when the open video's object changes (the service panel listens). */
export const VIDEOS_CHANGED = "dloserve:videos";
const NEGATIVE = "dloserve.negativePrompts"; // what this tab sent: the video object omits it

const state = {
  current: null,      // the open video object
  pollTimer: null,
  blobUrl: null,
  pageCursors: [null], // `after` of each page seen; the last is the page shown
  pageSize: 10,
  listed: new Map(),  // id -> video object on the page shown
  listTimer: null,
  generation: 0,      // bumped on every wipe: answers to older calls are dropped
  assigned: new Map(), // id -> its record in /v1/waves (queue wait, time on the rank)
  askedAt: new Map(),  // id -> the status /v1/waves was last asked at
  listSeq: 0,
};

export function rememberNegative(id, text) {
  const all = JSON.parse(sessionStorage.getItem(NEGATIVE) || "{}");
  all[id] = text;
  sessionStorage.setItem(NEGATIVE, JSON.stringify(all));
}
const negativeOf = (id) => JSON.parse(sessionStorage.getItem(NEGATIVE) || "{}")[id];

/** Videos of the caller that a rank holds now (for the service panel). */
export function running() {
  const all = new Map(state.listed);
  if (state.current) all.set(state.current.id, state.current);
  return [...all.values()].filter((v) => v.status === "in_progress");
}

// -- the open video ---------------------------------------------------------------------

function renderTimings(video) {
  const box = $("job-timings");
  const timings = video.timings;
  if (!timings || typeof timings !== "object") {
    box.hidden = true;
    return;
  }
  const value = (key, v) => {
    const unit = key.endsWith("_ms") ? " ms" : key.endsWith("_s") ? " s" : "";
    if (typeof v === "number") return `${Number(v.toFixed(3))}${unit}`;
    if (Array.isArray(v) && v.every((x) => typeof x === "number")) {
      const sum = v.reduce((a, b) => a + b, 0);
      return `${v.length} values, sum ${Number(sum.toFixed(3))}${unit}`;
    }
    return typeof v === "object" ? JSON.stringify(v) : String(v);
  };
  const rows = Object.entries(timings).map(([k, v]) => [k.replaceAll("_", " "), value(k, v)]);
  fillList(box.querySelector("dl"), rows);
  box.hidden = false;
}

function renderCurrent() {
  const video = state.current;
  $("job-empty").hidden = Boolean(video);
  $("job-view").hidden = !video;
  if (!video) { // empty, not just hidden: nothing of a closed video stays in the page
    delete $("job-view").dataset.id;
    for (const id of ["job-prompt", "job-status", "job-error", "job-msg"]) setText($(id), "");
    clear($("job-meta"));
    clear($("job-timings").querySelector("dl"));
    $("job-timings").hidden = true;
    $("job-progress").value = 0;
    setText($("job-progress-text"), "0%");
    return;
  }
  $("job-view").dataset.id = video.id;
  setText($("job-prompt"), video.prompt);
  setText($("job-status"), video.status.replaceAll("_", " "));
  $("job-status").className = statusClass(video.status);
  const progress = video.status === "completed" ? 100 : Number(video.progress) || 0;
  $("job-progress").value = progress;
  setText($("job-progress-text"), `${progress}%`);
  setText($("job-error"), video.error ? `${video.error.code}: ${video.error.message}` : "");
  setText($("job-delete"), UNFINISHED.has(video.status) ? "Cancel" : "Delete");
  const took = video.completed_at && video.created_at ? `${video.completed_at - video.created_at} s` : null;
  const assigned = state.assigned.get(video.id) || {};
  const secs = (v) => (typeof v === "number" ? `${v} s` : null);
  fillList($("job-meta"), [
    ["id", video.id], ["size", video.size], ["frames", video.num_frames], ["fps", video.fps],
    ["steps", video.num_inference_steps], ["guidance", video.guidance_scale], ["seed", video.seed],
    ["adapters", (video.loras || []).map((u) => `${u.name} × ${u.scale}`).join(", ")],
    ["cache", video.cache ? [video.cache.method, video.cache.threshold].filter((x) => x != null).join(" ") : null],
    ["priority", video.priority], ["paused", video.preemptions ? `${video.preemptions} ×` : null],
    ["resumed from step", video.resumed_from_step || null],
    ["model", video.model], ["created", when(video.created_at)], ["accepted to done", took],
    ["in queue", secs(assigned.queued_s)], ["on the rank", secs(assigned.latency_s)],
    ["rank", video.dp_rank], ["expires", when(video.expires_at)],
  ]);
  renderTimings(video);
  markSelected();
}

function dropVideo() {
  const player = $("job-video");
  player.pause();
  player.removeAttribute("src");
  player.load();
  player.hidden = true;
  player.style.removeProperty("aspect-ratio");
  $("job-download").hidden = true;
  $("job-download").removeAttribute("href");
  $("job-download").removeAttribute("download");
  if (state.blobUrl) URL.revokeObjectURL(state.blobUrl);
  state.blobUrl = null;
}

async function loadVideo(video, generation) {
  try {
    const {data} = await call(`v1/videos/${encodeURIComponent(video.id)}/content`, {as: "blob"});
    if (generation !== state.generation || state.current?.id !== video.id) return;
    dropVideo();
    state.blobUrl = URL.createObjectURL(data);
    const player = $("job-video");
    const [width, height] = String(video.size || "").split("x").map(Number);
    if (width > 0 && height > 0) player.style.aspectRatio = `${width} / ${height}`;
    player.src = state.blobUrl;
    player.hidden = false;
    const link = $("job-download");
    link.href = state.blobUrl;
    link.download = `${video.id}.mp4`;
    link.hidden = false;
  } catch (error) {
    if (generation !== state.generation) return;
    setText($("job-msg"), `The MP4 could not be loaded: ${error.message}`);
  }
}

/** Its queue wait and time on the rank, from the assignment history (once per status). */
async function loadAssignment(video, generation) {
  if (video.status === "queued" || state.askedAt.get(video.id) === video.status) return;
  state.askedAt.set(video.id, video.status);
  try {
    const {data} = await call("v1/waves");
    if (generation !== state.generation || !Array.isArray(data)) return;
    for (const rec of data) for (const id of rec.ids || []) state.assigned.set(id, rec);
    if (state.current?.id === video.id) renderCurrent();
  } catch {
    // The history is a nicety: without it the rest still shows.
  }
}

function schedulePoll(ms) {
  clearTimeout(state.pollTimer);
  state.pollTimer = setTimeout(poll, ms);
}

async function poll() {
  const video = state.current;
  if (!video) return;
  const generation = state.generation;
  try {
    const {data, headers} = await call(`v1/videos/${encodeURIComponent(video.id)}`);
    if (generation !== state.generation || state.current?.id !== video.id) return;
    show(data, {poll: false});
    if (UNFINISHED.has(data.status)) {
      schedulePoll(Math.max(250, Number(headers.get("openai-poll-after-ms")) || 500));
    } else {
      refreshList();
    }
  } catch (error) {
    if (generation !== state.generation) return;
    if (error.status === 404) {
      setText($("job-msg"), `${video.id} is gone (deleted or expired).`);
    } else if (error.status !== 401) {
      setText($("job-msg"), `Could not read the video: ${error.message}; trying again.`);
      schedulePoll(2000);
    }
  }
}

/** Open `video`: render it, poll it while unfinished, play it once completed. */
export function show(video, {poll: startPolling = true} = {}) {
  const previous = state.current;
  const sameVideo = previous && previous.id === video.id;
  if (!sameVideo) {
    dropVideo();
    setText($("job-msg"), "");
  }
  state.current = video;
  if (state.listed.has(video.id)) state.listed.set(video.id, video);
  renderCurrent();
  // The service panel re-renders its ranks now, not at its next /readyz: a short video can
  // start and end between two of those.
  document.dispatchEvent(new Event(VIDEOS_CHANGED));
  refreshPreview(video);
  loadAssignment(video, state.generation);
  const wasDone = sameVideo && previous.status === "completed" && state.blobUrl;
  if (video.status === "completed" && !wasDone) loadVideo(video, state.generation);
  if (startPolling && UNFINISHED.has(video.status)) schedulePoll(250);
}

async function removeCurrent() {
  const video = state.current;
  if (!video) return;
  const generation = state.generation;
  try {
    const {data} = await call(`v1/videos/${encodeURIComponent(video.id)}`, {method: "DELETE"});
    if (generation !== state.generation) return;
    if (data && data.deleted === false) { // it was running: cancelled at its next forward, keep it open
      setText($("job-msg"), `${video.id} is being cancelled; delete it again to remove it.`);
      poll();
      refreshList();
      return;
    }
    closeCurrent();
    setText($("jobs-done"), `Deleted ${video.id}.`);
    refreshList();
    $("jobs-h").focus();
  } catch (error) {
    if (generation !== state.generation || error.status === 401) return;
    setText($("job-msg"), error.message);
    if (error.status === 404) refreshList();
    else poll();
  }
}

function closeCurrent() {
  clearTimeout(state.pollTimer);
  clearPreview();
  dropVideo();
  state.current = null;
  renderCurrent();
  markSelected();
}

// -- the list ---------------------------------------------------------------------------

function markSelected() {
  for (const item of $("jobs-list").children) {
    const open = item.querySelector("button");
    if (state.current && item.dataset.id === state.current.id) open.setAttribute("aria-current", "true");
    else open.removeAttribute("aria-current");
  }
}

function fillItem(item, video) {
  const open = item.querySelector("button");
  clear(open);
  open.append(
    el("span", {class: `status ${statusClass(video.status)}`}, video.status.replaceAll("_", " ")),
    el("span", {class: "title"}, video.prompt ?? ""),
    el("span", {class: "sub"}, [video.size, `${video.num_frames} frames`, `${video.num_inference_steps} steps`,
      `seed ${video.seed}`, video.priority != null ? `priority ${video.priority}` : null,
      when(video.created_at)].filter(Boolean).join(" · ")),
  );
  const bar = item.querySelector("progress");
  bar.hidden = !UNFINISHED.has(video.status);
  bar.value = Number(video.progress) || 0;
  bar.setAttribute("aria-label", `progress of ${short(video.id)}`);
}

function newItem(video) {
  const open = el("button", {type: "button", class: "job-open"});
  open.addEventListener("click", () => show(state.listed.get(video.id) || video));
  return el("li", {dataset: {id: video.id}}, open, el("progress", {max: 100, value: 0}));
}

function renderList(videos, hasMore) {
  const list = $("jobs-list");
  const ids = videos.map((v) => v.id);
  const same = ids.length === list.children.length
    && ids.every((id, i) => list.children[i].dataset.id === id);
  if (!same) {
    const focusedId = document.activeElement?.closest?.("#jobs-list li")?.dataset.id;
    clear(list);
    for (const video of videos) list.append(newItem(video));
    if (focusedId) list.querySelector(`li[data-id="${CSS.escape(focusedId)}"] button`)?.focus();
  }
  videos.forEach((video, i) => fillItem(list.children[i], video));
  state.listed = new Map(videos.map((v) => [v.id, v]));
  const page = state.pageCursors.length;
  setText($("page-label"), `page ${page}`);
  $("page-newer").disabled = page === 1;
  $("page-older").disabled = !hasMore;
  setText($("jobs-msg"), videos.length ? "" : page === 1 ? "No videos yet." : "No older videos.");
  markSelected();
  // A listed video still running: refresh soon. The open one refreshes itself.
  clearTimeout(state.listTimer);
  if (videos.some((v) => UNFINISHED.has(v.status))) state.listTimer = setTimeout(refreshList, 2000);
}

export async function refreshList() {
  const generation = state.generation;
  const seq = ++state.listSeq; // only the latest call renders (a page-size change races the last)
  const after = state.pageCursors[state.pageCursors.length - 1];
  const query = new URLSearchParams({limit: String(state.pageSize), order: "desc"});
  if (after) query.set("after", after);
  try {
    const {data} = await call(`v1/videos?${query}`);
    if (generation !== state.generation || seq !== state.listSeq) return;
    if (!data.data.length && state.pageCursors.length > 1) { // the page emptied (deletes): step back
      state.pageCursors.pop();
      return refreshList();
    }
    renderList(data.data, data.has_more);
    if (state.current && state.listed.has(state.current.id) && !UNFINISHED.has(state.current.status)) {
      state.listed.set(state.current.id, state.current);
    }
  } catch (error) {
    if (generation === state.generation && seq === state.listSeq && error.status !== 401) {
      setText($("jobs-msg"), error.message);
    }
  }
}

/** Forget everything shown (a new or refused key): nothing of another key stays on screen;
 * `all` also forgets the negative prompts this tab sent. */
export function wipe(all = false) {
  state.generation += 1;
  if (all) sessionStorage.removeItem(NEGATIVE);
  clearTimeout(state.listTimer);
  closeCurrent();
  clear($("jobs-list"));
  state.listed = new Map();
  state.assigned = new Map();
  state.askedAt = new Map();
  state.pageCursors = [null];
  setText($("jobs-msg"), "");
  setText($("jobs-done"), "");
  setText($("job-msg"), "");
  setText($("page-label"), "page 1");
  $("page-newer").disabled = true;
  $("page-older").disabled = true;
}

export function init() {
  $("page-size").addEventListener("change", (event) => {
    state.pageSize = Number(event.target.value);
    state.pageCursors = [null];
    refreshList();
  });
  $("page-older").addEventListener("click", () => {
    const last = [...state.listed.keys()].pop();
    if (!last) return;
    state.pageCursors.push(last);
    refreshList();
  });
  $("page-newer").addEventListener("click", () => {
    if (state.pageCursors.length > 1) state.pageCursors.pop();
    refreshList();
  });
  $("jobs-refresh").addEventListener("click", () => refreshList());
  $("job-remix").addEventListener("click", () => {
    if (state.current) remix(state.current, negativeOf(state.current.id));
    setText($("create-msg"), state.current ? `Settings of ${state.current.id} are in the form.` : "");
  });
  $("job-delete").addEventListener("click", removeCurrent);
  $("page-newer").disabled = true;
  $("page-older").disabled = true;
}
