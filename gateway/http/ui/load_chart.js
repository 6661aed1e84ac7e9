// Live load per replica: tokens/s, running and waiting requests over the last WINDOW seconds, as three small
// SVG line charts (one line per replica, one colour per replica across the three) and a legend.
//
// The samples are the page's own: dashboard.js adds one per instance each time it reads /cluster (about once a
// second) and this module keeps them in a bounded buffer per instance (at most CAPACITY samples, none older than
// WINDOW). A line breaks where samples are missing (GAP), rather than drawing across an outage. No I/O here;
// imports only format.js and svg.js.
import { clip, perSecond } from "/ui/format.js";
import { svg, title } from "/ui/svg.js";

export const WINDOW = 300; // seconds shown
const CAPACITY = 2 * WINDOW; // samples kept per instance: enough for polls twice a second
const GAP = 4; // seconds without a sample that break a line
const COLOURS = 8; // .series-0 … .series-7 in dashboard.css
const METRICS = [
  { key: "tokensPerS", name: "Tokens/s", format: perSecond },
  { key: "running", name: "Running requests", format: String },
  { key: "queued", name: "Waiting requests", format: String },
];
const SIZE = { width: 320, height: 150, left: 34, right: 8, top: 24, bottom: 20 };

/** Samples per instance: {label, colour, samples: [{at, running, queued, tokensPerS}]}, oldest first. */
export class LoadHistory {
  constructor() {
    this.series = new Map();
    this.colours = 0;
  }

  /** One sample of `id` at `at` (Unix seconds); drops what is older than WINDOW or over CAPACITY. */
  add(at, id, label, load) {
    if (!this.series.has(id)) this.series.set(id, { label, colour: this.colours++ % COLOURS, samples: [] });
    const series = this.series.get(id);
    series.label = label;
    series.samples.push({ at, running: load.running, queued: load.queued, tokensPerS: load.tokensPerS });
    const old = series.samples.findIndex((s) => s.at >= at - WINDOW);
    series.samples.splice(0, Math.max(old, series.samples.length - CAPACITY, 0));
  }

  /** Forgets instances with no sample in the window (deleted ones fade out, then go). */
  prune(now) {
    for (const [id, series] of this.series) {
      if (!series.samples.some((s) => s.at >= now - WINDOW)) this.series.delete(id);
    }
  }
}

/** A round upper bound for the y axis: 1, 2, 5 times a power of ten, at least `floor`. */
function niceMax(peak, floor) {
  const top = Math.max(peak, floor);
  const power = 10 ** Math.floor(Math.log10(top));
  return [1, 2, 5, 10].map((m) => m * power).find((m) => m >= top);
}

function pathOf(samples, key, x, y) {
  let d = "";
  let last = null;
  for (const s of samples) {
    d += `${last === null || s.at - last > GAP ? "M" : "L"}${x(s.at).toFixed(1)},${y(s[key]).toFixed(1)}`;
    last = s.at;
  }
  return d;
}

function chart(metric, history, now) {
  const { width, height, left, right, top, bottom } = SIZE;
  const shown = [...history.series].map(([id, s]) => [id, s, s.samples.filter((p) => p.at >= now - WINDOW)]);
  const peak = Math.max(0, ...shown.flatMap(([, , samples]) => samples.map((p) => p[metric.key])));
  const max = niceMax(peak, metric.key === "tokensPerS" ? 10 : 2);
  const x = (at) => left + ((at - (now - WINDOW)) / WINDOW) * (width - left - right);
  const y = (value) => height - bottom - (value / max) * (height - top - bottom);
  const label = `${metric.name} per replica over the last ${WINDOW / 60} minutes; peak ${metric.format(peak)}`;
  return svg(
    "svg",
    { class: "chart", "data-metric": metric.key, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": label },
    title(label),
    svg("text", { x: left, y: 14, class: "chart-title" }, metric.name),
    [0, max / 2, max].filter((tick) => metric.key === "tokensPerS" || Number.isInteger(tick)).map((tick) => [
      svg("line", { class: "grid", x1: left, x2: width - right, y1: y(tick), y2: y(tick) }),
      svg("text", { x: left - 4, y: y(tick) + 4, "text-anchor": "end", class: "tick" }, String(+tick.toPrecision(3))),
    ]),
    svg("text", { x: left, y: height - 4, class: "tick" }, `−${WINDOW / 60} min`),
    svg("text", { x: width - right, y: height - 4, "text-anchor": "end", class: "tick" }, "now"),
    shown.map(([id, series, samples]) =>
      svg(
        "path",
        {
          class: `series series-${series.colour}`,
          d: pathOf(samples, metric.key, x, y),
          "data-instance": id,
          "data-points": samples.length,
          "data-peak": Math.max(0, ...samples.map((p) => p[metric.key])),
        },
        title(series.label),
      ),
    ),
  );
}

function legend(history) {
  const items = [...history.series].map(([id, series]) => {
    const last = series.samples.at(-1);
    const now = `${perSecond(last.tokensPerS)} tok/s, ${last.running} running, ${last.queued} waiting`;
    const item = document.createElement("li");
    item.dataset.instance = id;
    const swatch = document.createElement("span");
    swatch.className = `swatch series-${series.colour}`;
    swatch.setAttribute("aria-hidden", "true");
    item.append(swatch, `${clip(series.label, 60)}: ${now}`);
    return item;
  });
  const list = document.createElement("ul");
  list.className = "legend";
  if (!items.length) list.append(Object.assign(document.createElement("li"), { textContent: "no replica yet" }));
  list.append(...items);
  return list;
}

/** The three charts and the legend, as children for the chart section, drawn at `now` (Unix seconds). */
export function loadCharts(history, now) {
  const charts = document.createElement("div");
  charts.className = "charts";
  charts.append(...METRICS.map((metric) => chart(metric, history, now)));
  return [charts, legend(history)];
}
