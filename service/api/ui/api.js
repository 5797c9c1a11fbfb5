// The service's HTTP API as the page uses it: same origin, the API key from this browser
// session's storage (never localStorage: it ends with the tab), sent as a Bearer header.

const KEY = "dloserve.apiKey";
// The page lives at <base>/ui/, the API at <base>/ (a Serve route prefix is kept).
export const BASE = new URL("..", document.baseURI);

export const apiKey = {
  get: () => sessionStorage.getItem(KEY) || "",
  set(value) {
    if (value) sessionStorage.setItem(KEY, value);
    else sessionStorage.removeItem(KEY);
  },
};

const listeners = new Set();
/** Called with the server's message whenever a /v1 call answers 401. */
export function onUnauthorized(fn) {
  listeners.add(fn);
}

/** JSON.parse that keeps integers past 2^53 (seeds go to 2^63 - 1) as their exact digits. */
export function parseJSON(text) {
  return JSON.parse(text, (key, value, context) => {
    if (typeof value === "number" && !Number.isSafeInteger(value) && Number.isInteger(value)
        && context && typeof context.source === "string" && /^-?\d+$/.test(context.source)) {
      return context.source;
    }
    return value;
  });
}

export class ApiError extends Error {
  constructor(status, body, headers) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.param = err.param ?? null;
    this.code = err.code ?? null;
    this.retryAfter = headers ? headers.get("retry-after") : null;
  }
}

/**
 * One call. Resolves to {status, headers, data} for 2xx; throws ApiError otherwise (after
 * telling the 401 listeners) and a TypeError when the service cannot be reached.
 * opts: {method, body (FormData or object), as: "json" | "blob", auth (default true)}.
 */
export async function call(path, opts = {}) {
  const headers = {};
  const key = apiKey.get();
  if (key && opts.auth !== false) headers.Authorization = `Bearer ${key}`;
  let body;
  if (opts.body instanceof FormData) body = opts.body;
  else if (opts.body !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.body);
  }
  const response = await fetch(new URL(path, BASE), {method: opts.method || "GET", headers, body,
    cache: "no-store", credentials: "omit"});
  const ok = response.ok || (opts.okStatus || []).includes(response.status);
  if (ok && opts.as === "blob") return {status: response.status, headers: response.headers,
    data: await response.blob()};
  const text = await response.text();
  let data = null;
  try {
    data = text ? parseJSON(text) : null;
  } catch {
    data = null;
  }
  if (ok) return {status: response.status, headers: response.headers, data};
  const error = new ApiError(response.status, data, response.headers);
  // A refusal of the key this call was sent with; one for a key since replaced (the page's
  // first calls go out before a key is typed) is no news about the key in use.
  if (response.status === 401 && path.startsWith("v1/") && apiKey.get() === key) {
    listeners.forEach((fn) => fn(error.message));
  }
  throw error;
}
