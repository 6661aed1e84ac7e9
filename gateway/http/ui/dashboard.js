// meshgate dashboard: the cluster drawn (nodes, links, replicas), live load charts, and tables of nodes, links,
// instances and placement, kept live from the gateway's own API.
//
// Sources: GET /cluster (nodes, links, instances with their load; about once a second, and after each audit
// event: each read is a sample for the load charts), GET /events (the audit stream: polled with `since`, or read
// as server-sent events if the gateway streams it), GET /instances/{id}/events (server-sent state changes of a
// starting instance), GET /metrics (Prometheus text, every 2 s: this gateway's requests/s and tokens/s per
// instance over the last 10 s; "-" when it is not served; the charts' tokens/s when /cluster sends no `load`),
// GET /instances/previews, POST /instances and DELETE /instances/{id}. An admin key typed in the page is kept in
// sessionStorage and sent as `authorization: Bearer` (wire.js). Everything the server says is put in the page as
// text, never as HTML. The drawing is cluster_map.js, the charts load_chart.js.
import { clusterMap } from "/ui/cluster_map.js";
import { ago, bandwidth, bytes, clock, latency } from "/ui/format.js";
import { LoadHistory, loadCharts } from "/ui/load_chart.js";
import { AuthError, adminKey, errorText, loadOf, parseMetrics, readSSE, setAdminKey, sleep } from "/ui/wire.js";
import { api as wireApi, json as wireJson } from "/ui/wire.js";

const RATE_WINDOW = 10; // seconds of /metrics scrapes (every 2 s) a rate is computed over
const POLL = 1000; // ms between reads of /cluster: the load charts' sampling period
const $ = (selector) => document.querySelector(selector);
const state = {
  abort: new AbortController(), // aborted (and replaced) when the key changes: ends every loop and stream
  nodes: new Map(), // id -> node
  instances: new Map(), // id -> instance (InstanceView)
  history: new Map(), // instance id -> audit events about it
  streams: new Set(), // instance ids with a state stream open
  open: new Set(), // instance ids whose history is unfolded
  lastEventId: null,
  metrics: null, // null: not scraped yet; false: /metrics not served; else the scrapes of the last RATE_WINDOW s
  rates: new Map(), // instance id -> {rps, tps}
  previewed: null, // the constraints of the last preview, sent again with "place"
  load: new LoadHistory(), // instance id -> its samples for the charts (the last few minutes)
  drawn: null, // what the cluster map shows, to redraw it only when that changed
};

// ---------------------------------------------------------------- helpers

// Every call of this page ends when the key changes (start() aborts state.abort).
const api = (path, init = {}) => wireApi(path, { ...init, signal: state.abort.signal });
const json = (path, init = {}) => wireJson(path, { ...init, signal: state.abort.signal });

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) if (child !== null && child !== undefined) node.append(child);
  return node;
}

const nodeName = (id) => state.nodes.get(id)?.name ?? id;
const shortKind = (event) => event.kind.replace(/^instance\./, "");
const button = (label, onclick) => el("button", { class: label, type: "button", onclick }, label);
const perNode = (memory) => Object.entries(memory).map(([id, n]) => el("div", {}, `${nodeName(id)}: ${bytes(n)}`));

function setStatus(text, kind = "ok") {
  const status = $("#status");
  status.textContent = text;
  status.className = kind;
}

function report(error) {
  if (error.name === "AbortError") return;
  setStatus(error instanceof AuthError ? `${error.message} (enter an admin key above)` : error.message, "error");
}

// ---------------------------------------------------------------- nodes, links, instances

async function refresh() {
  const view = await json("/cluster");
  state.nodes = new Map(view.nodes.map((node) => [node.id, node]));
  state.instances = new Map(view.instances.map((instance) => [instance.id, instance]));
  renderNodes(view.nodes);
  renderLinks(view.links);
  renderInstances();
  drawLoad(view);
  for (const instance of view.instances) if (instance.state.state === "starting") watchInstance(instance.id);
  setStatus(`live: ${view.nodes.length} node(s), ${view.links.length} link(s), ${view.instances.length} instance(s)`);
}

// ---------------------------------------------------------------- the cluster map and the load charts

// An instance's load; without a cluster-wide `load`, tokens/s is this gateway's /metrics rate (0 without it).
const instanceLoad = (instance) => loadOf(instance, (state.metrics && state.rates.get(instance.id)?.tps) || 0);

function drawLoad(view) {
  const now = Date.now() / 1000;
  for (const instance of view.instances) {
    state.load.add(now, instance.id, `${instance.model} (${instance.id})`, instanceLoad(instance));
  }
  state.load.prune(now);
  $("#load-charts").replaceChildren(...loadCharts(state.load, now));
  const nodes = view.nodes.map(({ heartbeat_at, ...node }) => node); // a heartbeat alone changes nothing drawn
  const instances = view.instances.map((i) => [i.id, i.model, i.state, i.placement, instanceLoad(i)]);
  const drawn = JSON.stringify([nodes, view.links, instances]);
  if (drawn !== state.drawn) {
    state.drawn = drawn;
    $("#cluster-drawing").replaceChildren(clusterMap(view, instanceLoad));
  }
}

let pending = null;
function refreshSoon() {
  pending ??= setTimeout(() => {
    pending = null;
    refresh().catch(report);
  }, 150);
}

function renderNodes(nodes) {
  const placed = new Map(); // node id -> memory the instances' placements reserve there
  for (const instance of state.instances.values()) {
    for (const [id, n] of Object.entries(instance.placement.memory_per_node)) placed.set(id, (placed.get(id) ?? 0) + n);
  }
  $("#nodes tbody").replaceChildren(
    ...nodes.map((node) =>
      el(
        "tr",
        { "data-node": node.id },
        el("td", { class: "name" }, node.name, node.name === node.id ? null : el("small", {}, ` ${node.id}`)),
        el("td", {}, node.address),
        el("td", {}, `${bytes(node.memory_available)} / ${bytes(node.memory_total)}`),
        el("td", { class: "placed" }, bytes(placed.get(node.id) ?? 0)),
        el("td", { class: "cores" }, String(node.cpu_count)),
        el("td", {}, (node.flops / 1e9).toFixed(1)),
        el("td", {}, Object.keys(node.runtimes).join(", ") || "-"),
        el("td", {}, ago(node.heartbeat_at)),
      ),
    ),
  );
}

function renderLinks(links) {
  $("#links tbody").replaceChildren(
    ...links.map((link) =>
      el(
        "tr",
        { "data-link": `${link.src}>${link.dst}` },
        el("td", {}, nodeName(link.src)),
        el("td", {}, nodeName(link.dst)),
        el("td", { class: "bandwidth" }, bandwidth(link.bandwidth)),
        el("td", { class: "latency" }, latency(link.latency)),
        el("td", {}, ago(link.measured_at)),
      ),
    ),
  );
}

function shardText(shard) {
  const layers = `layers [${shard.layer_start}:${shard.layer_end}]`; // a slice, as `meshgate ps` writes it
  const rank = shard.tensor_size > 1 ? `, rank ${shard.tensor_rank}/${shard.tensor_size}` : "";
  return `${nodeName(shard.node_id)}: ${layers}${rank}${shard.holds_embedding ? ", embedding" : ""}`;
}

function rate(id, field) {
  if (!state.metrics) return "-";
  const value = state.rates.get(id)?.[field];
  return value === undefined ? "-" : value.toFixed(field === "rps" ? 2 : 1);
}


// This gateway's queue for an instance by class (admission's Load): how many of its requests running and waiting
// are interactive and how many batch (batch jobs' lines, service_tier flex, keys of the batch class).
function queueText(queue) {
  const side = (all, batch) => (batch ? `${all - batch} interactive + ${batch} batch` : `${all}`);
  const active = side(queue.active, queue.batch_active ?? 0);
  return `${active} active, ${side(queue.queued, queue.batch_queued ?? 0)} waiting`;
}

function instanceRow(instance) {
  const { id, state: current, placement } = instance;
  const history = state.history.get(id) ?? [];
  const details = el(
    "details",
    { ontoggle: (event) => (event.target.open ? state.open.add(id) : state.open.delete(id)) },
    el("summary", {}, `${history.length} event(s)`),
    el(
      "ol",
      { class: "history" },
      ...history.map((e) => el("li", {}, `${clock(e.at)} ${shortKind(e)}: ${e.message}`)),
    ),
  );
  details.open = state.open.has(id);
  const queue = instance.queue ? queueText(instance.queue) : "-";
  return el(
    "tr",
    { "data-instance": id },
    el("td", { class: "id" }, id),
    el("td", {}, instance.model),
    el(
      "td",
      { title: current.reason ?? "" },
      el("span", { class: `state state-${current.state}` }, current.state),
      current.reason ? el("div", { class: "reason" }, current.reason) : null,
    ),
    el(
      "td",
      { class: "placement" },
      el("div", {}, `${placement.strategy} (${placement.backend})`),
      ...placement.shards.map((shard) => el("div", {}, shardText(shard))),
    ),
    el("td", { class: "memory" }, ...perNode(placement.memory_per_node)),
    el("td", { class: "rps" }, rate(id, "rps")),
    el("td", { class: "tps" }, rate(id, "tps")),
    el("td", {}, queue),
    el("td", {}, details),
    el("td", {}, button("delete", () => remove(id).catch(report))),
  );
}

// Rows are replaced only when what they show changed, so a button is not swapped under a click.
function renderInstances() {
  const body = $("#instances tbody");
  const rows = new Map([...body.children].map((row) => [row.dataset.instance, row]));
  const ordered = [...state.instances.values()].sort((a, b) => a.created_at - b.created_at);
  const wanted = ordered.map((instance) => {
    const { id } = instance;
    const history = state.history.get(id)?.length;
    const { load, ...shown } = instance; // the load moves every second: the charts show it, not the row
    const signature = JSON.stringify([shown, history, rate(id, "rps"), rate(id, "tps"), [...state.nodes.keys()]]);
    const old = rows.get(id);
    if (old && old.dataset.signature === signature) return old;
    const row = instanceRow(instance);
    row.dataset.signature = signature;
    return row;
  });
  const same = wanted.length === body.children.length && wanted.every((row, i) => body.children[i] === row);
  if (!same) body.replaceChildren(...wanted);
}

function update(instance) {
  const known = state.instances.get(instance.id);
  state.instances.set(instance.id, { ...known, ...instance });
  renderInstances();
}

// A starting instance's state changes, as the gateway streams them, until it is ready, failed or deleted.
async function watchInstance(id) {
  if (state.streams.has(id)) return;
  state.streams.add(id);
  try {
    const path = `/instances/${encodeURIComponent(id)}/events`;
    const response = await api(path, { headers: { accept: "text/event-stream" } });
    if (!response.ok) return;
    await readSSE(response, (message) => {
      if (message.event !== "deleted" && state.instances.has(id)) update(JSON.parse(message.data));
    });
    refreshSoon();
  } catch (error) {
    report(error);
  } finally {
    state.streams.delete(id);
  }
}

async function remove(id) {
  if (!window.confirm(`Delete instance ${id} and stop its runners?`)) return;
  await json(`/instances/${encodeURIComponent(id)}`, { method: "DELETE" });
  state.instances.delete(id);
  renderInstances();
  setStatus(`deleted ${id}`);
}

// ---------------------------------------------------------------- the audit stream

function addEvents(events) {
  const list = $("#events");
  for (const event of events) {
    state.lastEventId = event.id;
    if (event.instance_id) {
      if (!state.history.has(event.instance_id)) state.history.set(event.instance_id, []);
      state.history.get(event.instance_id).push(event);
    }
    const where = event.instance_id ?? event.node_id ?? "";
    const line = `${clock(event.at)} ${event.kind} ${where}: ${event.message}`;
    // A decision's figures (autoscaling: queued, waited_s, idle_s, replicas, bounds) show on hover.
    const figures = Object.entries(event.data ?? {}).filter(([name]) => name !== "reason" && name !== "placement");
    const title = figures.map(([name, value]) => `${name} ${value}`).join(", ");
    list.prepend(el("li", { "data-kind": event.kind, ...(title ? { title } : {}) }, line));
  }
  while (list.children.length > 200) list.lastElementChild.remove();
  if (events.length) refreshSoon();
}

// The audit stream from the oldest event kept: a JSON page of up to BATCH events after `since` (the next page at
// once when one is full), or server-sent events if the gateway streams them; reconnects 2 s after each.
async function followEvents(signal) {
  const BATCH = 1000;
  while (!signal.aborted) {
    let full = false;
    try {
      const params = new URLSearchParams({ count: String(BATCH) });
      if (state.lastEventId) params.set("since", state.lastEventId);
      const accept = "text/event-stream, application/json";
      const response = await api(`/events?${params}`, { headers: { accept } });
      if (!response.ok) throw new Error(await errorText(response));
      if ((response.headers.get("content-type") ?? "").includes("text/event-stream")) {
        await readSSE(response, (message) => addEvents([JSON.parse(message.data)]));
      } else {
        const events = await response.json();
        addEvents(events);
        full = events.length >= BATCH;
      }
    } catch (error) {
      report(error);
    }
    if (!full) await sleep(2000, signal);
  }
}

// ---------------------------------------------------------------- rates from /metrics

// Rates over the last RATE_WINDOW seconds: the newest scrape against the oldest kept within the window.
// A gateway without /metrics (404), or one that cannot be read, shows "-": no error, rates are optional.
async function scrape() {
  let response = null;
  try {
    response = await api("/metrics", { headers: { accept: "text/plain" } });
  } catch (error) {
    if (error instanceof AuthError) throw error;
  }
  if (!response?.ok) {
    state.metrics = false;
    state.rates.clear();
  } else {
    const sample = { at: performance.now() / 1000, counts: parseMetrics(await response.text()) };
    const kept = (state.metrics || []).filter((old) => sample.at - old.at <= RATE_WINDOW);
    const oldest = kept[0];
    if (oldest) {
      const seconds = Math.max(sample.at - oldest.at, 1e-3);
      for (const id of state.instances.keys()) {
        const now = sample.counts.get(id) ?? { requests: 0, tokens: 0 };
        const before = oldest.counts.get(id) ?? { requests: 0, tokens: 0 };
        state.rates.set(id, {
          rps: Math.max(0, now.requests - before.requests) / seconds,
          tps: Math.max(0, now.tokens - before.tokens) / seconds,
        });
      }
    }
    state.metrics = [...kept, sample];
  }
  renderInstances();
}

// ---------------------------------------------------------------- placement preview, place

async function preview(event) {
  event.preventDefault();
  const constraints = { model: $("#preview-model").value.trim() };
  const nodes = $("#preview-nodes").value.split(",").map((n) => n.trim()).filter(Boolean);
  if (nodes.length) constraints.nodes = nodes;
  if ($("#preview-strategy").value) constraints.strategy = $("#preview-strategy").value;
  const params = new URLSearchParams({ model: constraints.model });
  if (nodes.length) params.set("nodes", nodes.join(","));
  if (constraints.strategy) params.set("strategy", constraints.strategy);
  $("#candidates tbody").replaceChildren();
  const body = await json(`/instances/previews?${params}`);
  state.previewed = { ...constraints, model: body.model };
  $("#candidates tbody").replaceChildren(
    ...body.candidates.map((c) =>
      el(
        "tr",
        { "data-candidate": c.id, class: c.fits ? "fits" : "rejected" },
        el("td", {}, c.strategy),
        el("td", {}, c.backend),
        el("td", {}, ...c.shards.map((s) => el("div", {}, shardText(s)))),
        el("td", {}, ...perNode(c.memory_per_node)),
        el("td", {}, c.tok_s ? c.tok_s.toFixed(1) : "-"),
        el("td", {}, c.link_cost ? `${(c.link_cost * 1000).toFixed(2)} ms/token` : "-"),
        el("td", {}, c.fits ? "yes" : `no: ${c.reason}`),
        el("td", {}, c.fits ? button("place", (event) => place(c.id, event.target).catch(report)) : null),
      ),
    ),
  );
  setStatus(`${body.candidates.length} candidate(s) for ${body.model}`);
}

async function place(candidateId, target) {
  target.disabled = true;
  try {
    const instance = await json("/instances", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ ...state.previewed, candidate_id: candidateId }),
    });
    update(instance);
    watchInstance(instance.id);
    setStatus(`placed ${instance.model} as ${instance.id}`);
  } finally {
    target.disabled = false;
  }
}

// ---------------------------------------------------------------- start

function start() {
  state.abort.abort();
  state.abort = new AbortController();
  const signal = state.abort.signal;
  state.lastEventId = null;
  state.drawn = null;
  state.history.clear();
  state.streams.clear();
  $("#events").replaceChildren();
  followEvents(signal);
  (async () => {
    while (!signal.aborted) {
      const started = performance.now();
      const refused = await refresh().then(
        () => false,
        (error) => (report(error), error instanceof AuthError),
      );
      await sleep(refused ? 5 * POLL : Math.max(100, POLL - (performance.now() - started)), signal); // no key: slower
    }
  })();
  (async () => {
    while (!signal.aborted) {
      await scrape().catch(report);
      await sleep(2000, signal);
    }
  })();
}

document.addEventListener("DOMContentLoaded", () => {
  $("#api-key").value = adminKey();
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setAdminKey($("#api-key").value.trim());
    start();
  });
  $("#preview-form").addEventListener("submit", (event) => preview(event).catch(report));
  start();
});
