// The running video's preview beside the progress bar: GET /v1/videos/{id}/preview with the
// ETag of the image shown (304: nothing new), at most once per poll. Hidden before the first
// step (404) and once the video ends (the player takes its place).

import {apiKey, BASE} from "./api.js";

const shown = {id: null, etag: null, url: null, seq: 0};

/** Forget the image (another video, a new key, the end of this one). */
export function clearPreview() {
  shown.seq += 1; // answers to calls made before this are dropped
  const img = document.getElementById("job-preview");
  img.hidden = true;
  img.removeAttribute("src");
  if (shown.url) URL.revokeObjectURL(shown.url);
  Object.assign(shown, {id: null, etag: null, url: null});
}

/** Ask for a newer preview of `video` while it runs. */
export async function refreshPreview(video) {
  if (!video || video.status !== "in_progress") {
    clearPreview();
    return;
  }
  if (shown.id !== video.id) clearPreview();
  shown.id = video.id;
  const seq = shown.seq;
  const headers = {};
  const key = apiKey.get();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (shown.etag) headers["If-None-Match"] = shown.etag;
  let response;
  try {
    response = await fetch(new URL(`v1/videos/${encodeURIComponent(video.id)}/preview`, BASE),
      {headers, cache: "no-store", credentials: "omit"});
  } catch {
    return; // a preview is a nicety: the progress bar still shows
  }
  if (seq !== shown.seq || response.status !== 200) return;
  const blob = await response.blob();
  if (seq !== shown.seq) return;
  if (shown.url) URL.revokeObjectURL(shown.url);
  shown.url = URL.createObjectURL(blob);
  shown.etag = response.headers.get("etag");
  const img = document.getElementById("job-preview");
  img.src = shown.url;
  img.title = `step ${response.headers.get("x-preview-step") || "?"}`;
  img.hidden = false;
}
