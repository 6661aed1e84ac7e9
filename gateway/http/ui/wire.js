// The dashboard's wire: the admin key, authenticated fetch, server-sent events over fetch, Prometheus counters.
//
// EventSource cannot send headers, so server-sent streams are read from a fetch body (readSSE). The key lives in
// sessionStorage (this tab only) and goes out as `authorization: Bearer`. No DOM here; dashboard.js draws.

const KEY = "meshgate.adminKey";

export const adminKey = () => sessionStorage.getItem(KEY) ?? "";

export function setAdminKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

/** 401 or 403 from the gateway: no key, a wrong one, or one without the admin scope. */
export class AuthError extends Error {}

export async function errorText(response) {
  try {
    const body = await response.json();
    return body?.error?.message ?? body?.error ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

/** fetch with the admin key; throws AuthError on 401/403 (the page then asks for a key). */
export async function api(path, init = {}) {
  const headers = new Headers(init.headers ?? {});
  const key = adminKey();
  if (key) headers.set("authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401 || response.status === 403) throw new AuthError(await errorText(response));
  return response;
}

/** The JSON body of a successful answer (null for 204); an Error with the gateway's message otherwise. */
export async function json(path, init) {
  const response = await api(path, init);
  if (!response.ok) throw new Error(await errorText(response));
  return response.status === 204 ? null : response.json();
}

// Server-sent events from a fetch response: calls onMessage({event, data, id}) per event, until the stream ends.
export async function readSSE(response, onMessage) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const blocks = buffer.split(/\r\n\r\n|\n\n|\r\r/);
    buffer = blocks.pop();
    for (const block of blocks) {
      const message = { event: "message", data: [], id: null };
      for (const line of block.split(/\r\n|\n|\r/)) {
        if (!line || line.startsWith(":")) continue; // comments are keep-alives
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") message.data.push(text);
        else if (field === "event") message.event = text;
        else if (field === "id") message.id = text;
      }
      if (message.data.length) onMessage({ ...message, data: message.data.join("\n") });
    }
  }
}

// name{labels} value: a label value may hold "}" and escapes (\\, \", \n); timestamps after the value are ignored
const COUNTER =
  /^(meshgate_instance_requests_total|meshgate_generated_tokens_total)\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}\s+(\S+)/;
const LABEL = /([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

export function parseMetrics(text) {
  const counts = new Map(); // instance id -> {requests, tokens}
  for (const line of text.split("\n")) {
    const match = COUNTER.exec(line);
    if (!match) continue;
    const unescaped = (value) => value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    const labels = Object.fromEntries([...match[2].matchAll(LABEL)].map(([, k, v]) => [k, unescaped(v)]));
    if (!labels.instance) continue;
    const entry = counts.get(labels.instance) ?? { requests: 0, tokens: 0 };
    entry[match[1] === "meshgate_instance_requests_total" ? "requests" : "tokens"] += Number(match[3]);
    counts.set(labels.instance, entry);
  }
  return counts;
}

/** Resolves after `ms`, or at once when `signal` aborts. */
export const sleep = (ms, signal) =>
  new Promise((resolve) => {
    const wake = () => (clearTimeout(timer), signal.removeEventListener("abort", wake), resolve());
    const timer = setTimeout(wake, ms);
    signal.addEventListener("abort", wake);
  });

const count = (x) => (Number.isFinite(x) ? x : 0);

/**
 * An instance's load as {running, queued, tokensPerS, scope}: the cluster-wide `load` (summed over gateways) when
 * the gateway sends one, else this gateway's `queue` with `fallbackTokensPerS` (the page's /metrics rate, or 0).
 */
export function loadOf(instance, fallbackTokensPerS = 0) {
  const load = instance.load;
  if (load && typeof load === "object") {
    return {
      running: count(load.running),
      queued: count(load.queued),
      tokensPerS: count(load.tokens_per_s),
      scope: "cluster",
    };
  }
  return {
    running: count(instance.queue?.active),
    queued: count(instance.queue?.queued),
    tokensPerS: count(fallbackTokensPerS),
    scope: "this gateway",
  };
}
