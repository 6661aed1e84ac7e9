// The cluster drawn as an SVG picture: nodes as boxes (name, free memory, a bar of the memory placements
// reserve), measured links as lines labelled with each direction's latency and bandwidth, and each replica
// (instance) as a pill on every node that holds one of its shards, coloured by state, with its running and
// waiting requests and tokens/s.
//
// Layout: one node in the middle, two side by side, three or more on an ellipse, so no link crosses a box it
// does not end at. The picture is rebuilt whole when what it shows changed. No I/O here: dashboard.js passes
// the /cluster view and each instance's load. Imports only format.js and svg.js.
import { bandwidth, bytes, clip, latency, perSecond } from "/ui/format.js";
import { svg, title } from "/ui/svg.js";

const BOX = { width: 270, head: 66, row: 44, pad: 8 };
const LABEL = { line: 15, char: 6.4, pad: 6 }; // a link label: line height, width of a character, padding

/** Centres of n boxes of height `h`: a row for up to two, else an ellipse far enough apart that a label fits
 * between two neighbours. */
function layout(n, h) {
  const width = Math.max(960, n * (BOX.width + 40));
  if (n <= 2) {
    const height = h + 40;
    const xs = n === 1 ? [width / 2] : [width * 0.22, width * 0.78];
    return { width, height, centres: xs.map((x) => ({ x, y: height / 2 })) };
  }
  const ry = h + 50;
  const height = 2 * ry + h + 40;
  const rx = width / 2 - BOX.width / 2 - 20;
  const centres = Array.from({ length: n }, (_, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / n; // the first node on top, then clockwise
    return { x: width / 2 + rx * Math.cos(angle), y: height / 2 + ry * Math.sin(angle) };
  });
  return { width, height, centres };
}

const overlaps = (r, q) => r.x < q.x + q.width && q.x < r.x + r.width && r.y < q.y + q.height && q.y < r.y + r.height;

/** Where a label of `width` x `height` goes on the segment a-b: the first of a few points along it that covers
 * no box and no label placed before (`taken`, which it joins), else the middle. */
function labelBox(a, b, width, height, taken) {
  const at = (t) => ({ x: a.x + (b.x - a.x) * t - width / 2, y: a.y + (b.y - a.y) * t - height / 2, width, height });
  const box = [0.5, 0.38, 0.62, 0.3, 0.7].map(at).find((r) => !taken.some((q) => overlaps(r, q))) ?? at(0.5);
  taken.push(box);
  return box;
}

/** The replicas with a shard on each node: node id -> [{instance, shard}]. */
function replicasByNode(instances) {
  const on = new Map();
  for (const instance of instances) {
    for (const shard of instance.placement.shards) {
      if (!on.has(shard.node_id)) on.set(shard.node_id, []);
      on.get(shard.node_id).push({ instance, shard });
    }
  }
  return on;
}

/** The measured directions of each pair of nodes: "a|b" (sorted) -> [link, ...]. */
function linkPairs(links) {
  const pairs = new Map();
  for (const link of links) {
    const key = [link.src, link.dst].sort().join("|");
    if (!pairs.has(key)) pairs.set(key, []);
    pairs.get(key).push(link);
  }
  return pairs;
}

/** An arrow for the direction from `p` to `q` as drawn: along the line's longer axis. */
function arrow(p, q) {
  const dx = q.x - p.x;
  const dy = q.y - p.y;
  return Math.abs(dx) >= Math.abs(dy) ? (dx >= 0 ? "→" : "←") : dy >= 0 ? "↓" : "↑";
}

/** A pair of nodes' link: one line, labelled with each measured direction (an arrow as drawn; names in the
 * tooltip). */
function drawLink(at, measured, names, taken) {
  const [a, b] = [at.get(measured[0].src), at.get(measured[0].dst)];
  const figures = (l) => `${latency(l.latency)}, ${bandwidth(l.bandwidth)}`;
  const lines = measured.map((l) => `${arrow(at.get(l.src), at.get(l.dst))} ${figures(l)}`);
  const width = Math.max(...lines.map((line) => line.length)) * LABEL.char + 2 * LABEL.pad;
  const label = labelBox(a, b, width, LABEL.line * lines.length + LABEL.pad, taken);
  const tip = measured.map((l) => `${names(l.src)} → ${names(l.dst)}: ${figures(l)}`);
  return svg(
    "g",
    { class: "link", "data-link": measured.map((l) => `${l.src}>${l.dst}`).join(" ") },
    title(tip.join("\n")),
    svg("line", { x1: a.x, y1: a.y, x2: b.x, y2: b.y }),
    svg("rect", { class: "label", ...label, rx: 4 }),
    lines.map((line, i) =>
      svg("text", { x: label.x + label.width / 2, y: label.y + LABEL.line * (i + 1), "text-anchor": "middle" }, line),
    ),
  );
}

function drawReplica({ instance, shard }, load, x, y) {
  const { id, model, state } = instance;
  const layers = `layers [${shard.layer_start}:${shard.layer_end}]`;
  const rank = shard.tensor_size > 1 ? `, rank ${shard.tensor_rank}/${shard.tensor_size}` : "";
  const tip = `${model} (${id}): ${state.state}${state.reason ? `, ${state.reason}` : ""}; ${layers}${rank}; `;
  const counts = `${load.running} running · ${load.queued} waiting · ${perSecond(load.tokensPerS)} tok/s`;
  return svg(
    "g",
    { class: `replica state-${state.state}`, "data-instance": id, "data-node": shard.node_id },
    title(`${tip}${counts} (${load.scope})`),
    svg("rect", { x, y, width: BOX.width - 2 * BOX.pad, height: BOX.row - 6, rx: 6 }),
    svg(
      "text",
      { x: x + 8, y: y + 16, class: "model" },
      clip(model, 18),
      svg("tspan", { class: "state" }, ` ${state.state}`),
    ),
    svg("text", { x: x + BOX.width - 2 * BOX.pad - 8, y: y + 16, "text-anchor": "end", class: "layers" }, layers),
    svg(
      "text",
      { x: x + 8, y: y + 32, class: "counts" },
      svg("tspan", { class: "running" }, String(load.running)),
      " running · ",
      svg("tspan", { class: "waiting" }, String(load.queued)),
      " waiting · ",
      svg("tspan", { class: "tokens" }, perSecond(load.tokensPerS)),
      " tok/s",
    ),
  );
}

function drawNode(node, centre, height, replicas, loadOf) {
  const left = centre.x - BOX.width / 2;
  const top = centre.y - height / 2;
  const placed = replicas.reduce((sum, r) => sum + (r.instance.placement.memory_per_node[node.id] ?? 0), 0);
  const barWidth = BOX.width - 2 * BOX.pad;
  const share = node.memory_total ? Math.min(1, placed / node.memory_total) : 0;
  const memory = `${bytes(node.memory_available)} free / ${bytes(node.memory_total)}`;
  const draining = node.draining_until != null; // told to stop: its replicas drain, nothing new is placed there
  const cores = `${node.cpu_count} cores`;
  const about = `${node.name} (${node.id}) at ${node.address}: ${memory}, ${bytes(placed)} placed, ${cores}`;
  return svg(
    "g",
    { class: draining ? "node draining" : "node", "data-node": node.id },
    title(draining ? `${about}; draining, stopping` : about),
    svg("rect", { class: "box", x: left, y: top, width: BOX.width, height, rx: 8 }),
    svg("text", { x: left + BOX.pad, y: top + 20, class: "name" }, clip(node.name, draining ? 19 : 30)),
    draining ? svg("text", { x: left + BOX.width - BOX.pad, y: top + 20, "text-anchor": "end" }, "draining") : [],
    svg("text", { x: left + BOX.pad, y: top + 38, class: "memory" }, memory),
    svg("rect", { class: "bar", x: left + BOX.pad, y: top + 46, width: barWidth, height: 6, rx: 3 }),
    svg("rect", { class: "bar-placed", x: left + BOX.pad, y: top + 46, width: barWidth * share, height: 6, rx: 3 }),
    replicas.length
      ? replicas.map((r, i) => drawReplica(r, loadOf(r.instance), left + BOX.pad, top + BOX.head + i * BOX.row))
      : svg("text", { x: left + BOX.pad, y: top + BOX.head + 16, class: "empty" }, "no replica"),
  );
}

/** What the picture says, for screen readers (the picture's `<desc>`). */
function describe(view, loadOf) {
  const replicas = view.instances.map((i) => {
    const load = loadOf(i);
    const nodes = [...new Set(i.placement.shards.map((s) => s.node_id))].join(", ");
    return `${i.model} on ${nodes}, ${i.state.state}, ${load.running} running, ${load.queued} waiting`;
  });
  const names = view.nodes.map((n) => n.name).join(", ");
  return `${view.nodes.length} node(s): ${names}. ${view.links.length} measured link(s). ${replicas.length} replica(s)${
    replicas.length ? `: ${replicas.join("; ")}` : ""
  }.`;
}

/**
 * The cluster as an `<svg>` element: `view` is GET /cluster's body, `loadOf(instance)` an instance's
 * {running, queued, tokensPerS, scope}.
 */
export function clusterMap(view, loadOf) {
  const on = replicasByNode(view.instances);
  const rows = Math.max(1, ...view.nodes.map((n) => on.get(n.id)?.length ?? 0));
  const height = BOX.head + rows * BOX.row + BOX.pad;
  const { width, height: total, centres } = layout(view.nodes.length, height);
  const at = new Map(view.nodes.map((node, i) => [node.id, centres[i]]));
  const names = (id) => view.nodes.find((n) => n.id === id)?.name ?? id;
  const taken = view.nodes.map((node) => {
    const { x, y } = at.get(node.id);
    return { x: x - BOX.width / 2, y: y - height / 2, width: BOX.width, height }; // labels keep off the boxes
  });
  const links = [...linkPairs(view.links).values()]
    .filter((measured) => at.has(measured[0].src) && at.has(measured[0].dst)) // not to a node gone
    .map((measured) => drawLink(at, measured, names, taken));
  return svg(
    "svg",
    {
      id: "cluster-map",
      viewBox: `0 0 ${width} ${view.nodes.length ? total : 80}`,
      role: "img",
      "aria-labelledby": "cluster-map-title cluster-map-desc",
    },
    svg("title", { id: "cluster-map-title" }, "Cluster map"),
    svg("desc", { id: "cluster-map-desc" }, describe(view, loadOf)),
    view.nodes.length ? null : svg("text", { x: 20, y: 40, class: "empty" }, "no node has joined yet"),
    links,
    view.nodes.map((node) => drawNode(node, at.get(node.id), height, on.get(node.id) ?? [], loadOf)),
  );
}
