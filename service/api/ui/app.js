// The playground's wiring: the key, the create form, the video, the list, the service.

import {apiKey, onUnauthorized} from "./api.js";
import {$, setText} from "./dom.js";
import * as extras from "./extras.js";
import {clearErrors, loadLimits, showError, submit} from "./form.js";
import * as jobs from "./jobs.js";
import {refreshStatus} from "./status.js";

let refused = false;

function keyMessage() {
  if (refused) return;
  $("key-msg").classList.remove("bad");
  setText($("key-msg"), apiKey.get() ? "Key set for this browser tab." : "No key set.");
}

/** Nothing of the last key stays: its videos, the form (a remix fills it) and errors. */
function forget() {
  jobs.wipe(true);
  $("create-form").reset();
  extras.clearAdapters(); // another key's adapters are not this one's
}

onUnauthorized((message) => {
  // Wrong or missing key: show nothing but the reason.
  refused = true;
  forget();
  $("key-msg").classList.add("bad");
  setText($("key-msg"), apiKey.get() ? `The service refused this key: ${message}`
    : "This service needs an API key: enter it above.");
});

function useKey(value) {
  const changed = value.trim() !== apiKey.get();
  apiKey.set(value.trim());
  refused = false;
  if (changed) forget();
  else jobs.wipe();
  keyMessage();
  jobs.refreshList();
  extras.loadAdapters();
  refreshStatus();
}

let sending = false;

async function create(event) {
  event.preventDefault();
  if (sending) return;
  sending = true;
  $("submit").setAttribute("aria-disabled", "true");
  clearErrors();
  setText($("create-msg"), "Sending…");
  const negative = $("f-negative_prompt").value;
  try {
    const {data} = await submit();
    jobs.rememberNegative(data.id, negative);
    setText($("create-msg"), `Queued ${data.id}.`);
    jobs.show(data);
    jobs.refreshList();
  } catch (error) {
    setText($("create-msg"), "");
    if (error.status === undefined) setText($("err-form"), `The service did not answer: ${error.message}`);
    else if (error.status !== 401) showError(error);
  } finally {
    sending = false;
    $("submit").removeAttribute("aria-disabled");
  }
}

function init() {
  $("api-key").value = apiKey.get();
  keyMessage();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    useKey($("api-key").value);
  });
  $("key-forget").addEventListener("click", () => {
    $("api-key").value = "";
    useKey("");
  });
  $("create-form").addEventListener("submit", create);
  $("create-form").addEventListener("reset", () => {
    clearErrors();
    setText($("create-msg"), "");
    setTimeout(extras.showThreshold); // after the select is back to its default
  });
  $("f-cache").addEventListener("change", extras.showThreshold);
  jobs.init();
  loadLimits().catch((error) => {
    setText($("err-form"), `Could not read the service's limits: ${error.message}`);
  }).finally(extras.loadAdapters); // after the limits: its hint states the adapter limit
  jobs.refreshList();
  refreshStatus();
}

init();
