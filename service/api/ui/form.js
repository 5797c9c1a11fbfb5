// The create form: limits from this instance's /openapi.json shown before submit, the
// server's 4xx message shown beside the field its `param` names, remix from a video.

import {call, parseJSON, BASE} from "./api.js";
import {$, setText} from "./dom.js";
import * as extras from "./extras.js";

export const FIELDS = ["prompt", "negative_prompt", "width", "height", "num_frames", "fps",
  "num_inference_steps", "guidance_scale", "seed", "priority", "input_reference"];
// Params the server may name that belong to a group or another control.
const PARAM_TO_ERROR = {size: "size", seconds: "num_frames", max_sequence_length: "prompt"};
const PARAM_TO_FOCUS = {size: "width", seconds: "num_frames", max_sequence_length: "prompt"};

const fmt = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : String(n));

/** The non-null branch of a "T | None" property. */
function branch(prop) {
  if (!prop) return null;
  if (Array.isArray(prop.anyOf)) return prop.anyOf.find((v) => v.type !== "null") || null;
  return prop;
}

/** "1, 5, 9 … 129 (4k + 1)" for an arithmetic enum, the list itself otherwise. */
function describeEnum(values) {
  const nums = values.filter((v) => typeof v === "number");
  if (nums.length > 4) {
    const step = nums[1] - nums[0];
    if (nums.every((v, i) => i === 0 || v - nums[i - 1] === step)) {
      const rest = nums[0] % step;
      return `${nums[0]}, ${nums[1]}, ${nums[2]} … ${nums[nums.length - 1]} (${step}k + ${rest})`;
    }
  }
  return values.join(", ");
}

function range(rule, unit = "") {
  const parts = [];
  if (rule.minimum !== undefined && rule.maximum !== undefined) {
    parts.push(`${fmt(rule.minimum)}–${fmt(rule.maximum)}${unit}`);
  }
  else if (rule.minimum !== undefined) parts.push(`at least ${fmt(rule.minimum)}${unit}`);
  else if (rule.maximum !== undefined) parts.push(`at most ${fmt(rule.maximum)}${unit}`);
  if (rule.multipleOf !== undefined) parts.push(`a multiple of ${fmt(rule.multipleOf)}`);
  return parts.join(", ");
}

/** Read the create body's rules from the instance schema and show them as hints. */
export async function loadLimits() {
  const response = await fetch(new URL("openapi.json", BASE), {cache: "no-store"});
  const spec = parseJSON(await response.text());
  const post = spec.paths["/v1/videos"].post.requestBody.content;
  const props = post["application/json"].schema.properties;
  const form = (post["multipart/form-data"] || {}).schema || {};
  const rules = {};
  for (const name of FIELDS) rules[name] = branch(props[name]) || branch((form.properties || {})[name]);

  const hint = (name, text) => text && setText($(`hint-${name}`), text);
  const attrs = (name, rule, step) => {
    const input = $(`f-${name}`);
    if (!rule || !input) return;
    if (typeof rule.minimum === "number") input.min = rule.minimum;
    if (typeof rule.maximum === "number") input.max = rule.maximum;
    if (step) input.step = step;
  };
  if (rules.prompt) hint("prompt", `Required; up to ${fmt(rules.prompt.maxLength)} characters.`);
  if (rules.negative_prompt) {
    hint("negative_prompt", rules.negative_prompt.maxLength === 0 ? "Not taken by this model."
      : `Optional; up to ${fmt(rules.negative_prompt.maxLength)} characters.`);
  }
  for (const name of ["width", "height"]) {
    if (!rules[name]) continue;
    hint(name, `${range(rules[name], " px")}.`);
    attrs(name, rules[name], rules[name].multipleOf);
  }
  const pixels = (rules.width || {})["x-max-pixels"];
  if (pixels) hint("size", `Width × height at most ${fmt(pixels)} pixels.`);
  if (rules.num_frames) {
    const values = rules.num_frames.enum;
    hint("num_frames", values ? `One of ${describeEnum(values)}.` : `${range(rules.num_frames)}.`);
    if (values) {
      $("f-num_frames").min = Math.min(...values);
      $("f-num_frames").max = Math.max(...values);
      if (values.length > 1) $("f-num_frames").step = values[1] - values[0];
    }
  }
  for (const name of ["fps", "num_inference_steps", "guidance_scale"]) {
    if (!rules[name]) continue;
    hint(name, `${range(rules[name])}.`);
    attrs(name, rules[name], name === "guidance_scale" ? "any" : 1);
  }
  if (rules.seed) hint("seed", `${range(rules.seed)}; empty: a random seed.`);
  if (rules.priority) {
    hint("priority", `${range(rules.priority)}; lower runs first and may pause a worse running job; `
      + "empty: 0 (or your key's floor).");
    attrs("priority", rules.priority, 1);
  }
  // a model that takes no image states it as {"not": {}}: no value is valid
  const image = rules.input_reference;
  $("field-input_reference").hidden = !image || (image.not && Object.keys(image.not).length === 0);
  extras.readRules(props);
  return rules;
}

export function clearErrors() {
  for (const node of document.querySelectorAll("#create-form .err")) setText(node, "");
  for (const node of document.querySelectorAll("#create-form [aria-invalid]")) {
    node.removeAttribute("aria-invalid");
  }
}

/** Show the server's message beside the field it names; the form's own line otherwise. */
export function showError(error) {
  const param = error.param;
  let text = error.message;
  if (error.retryAfter) text += ` (try again in ${error.retryAfter} s)`;
  const extra = extras.errorTarget(param);
  if (extra) {
    setText($(extra.err), text);
    if (extra.focus) focusInvalid($(extra.focus));
    return;
  }
  const target = PARAM_TO_ERROR[param] || param;
  const errNode = target && FIELDS.concat(["size"]).includes(target) ? $(`err-${target}`) : null;
  if (!errNode || (target === "input_reference" && $("field-input_reference").hidden)) {
    setText($("err-form"), param ? `${param}: ${text}` : text);
    return;
  }
  setText(errNode, text);
  focusInvalid($(`f-${PARAM_TO_FOCUS[param] || target}`));
}

function focusInvalid(input) {
  if (!input) return;
  input.setAttribute("aria-invalid", "true");
  input.focus();
}

/** The filled fields, as the strings typed (a form body: the server parses the numbers). */
export function formBody() {
  const body = new FormData();
  for (const name of FIELDS) {
    const input = $(`f-${name}`);
    if (name === "input_reference") {
      if (!$("field-input_reference").hidden && input.files.length) body.append(name, input.files[0]);
      continue;
    }
    const value = name.includes("prompt") ? input.value : input.value.trim();
    if (value !== "") body.append(name, value);
  }
  extras.addTo(body);
  return body;
}

export async function submit() {
  return call("v1/videos", {method: "POST", body: formBody()});
}

/** Refill the form from a video's settings (what the video object reports). */
export function remix(video, negativePrompt) {
  const [width, height] = String(video.size || "x").split("x");
  const values = {prompt: video.prompt, negative_prompt: video.negative_prompt ?? negativePrompt ?? "",
    width, height, num_frames: video.num_frames, fps: video.fps,
    num_inference_steps: video.num_inference_steps, guidance_scale: video.guidance_scale, seed: video.seed,
    priority: video.priority};
  for (const [name, value] of Object.entries(values)) {
    $(`f-${name}`).value = value === undefined || value === null ? "" : String(value);
  }
  clearErrors();
  extras.remix(video);
  $("f-prompt").focus();
}
