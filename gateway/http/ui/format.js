// How the dashboard writes numbers: memory, bandwidth, latency, times. No DOM here; shared by the tables and
// the drawings. Imports nothing.

export const bytes = (n) => (n >= 2 ** 30 ? `${(n / 2 ** 30).toFixed(2)} GiB` : `${(n / 2 ** 20).toFixed(0)} MiB`);
export const bandwidth = (bps) =>
  bps >= 1.25e8 ? `${((bps * 8) / 1e9).toFixed(2)} Gbit/s` : `${((bps * 8) / 1e6).toFixed(1)} Mbit/s`;
export const latency = (seconds) => `${(seconds * 1000).toFixed(2)} ms`;
export const ago = (t) => (t ? `${Math.max(0, Date.now() / 1000 - t).toFixed(1)} s ago` : "-");
export const clock = (t) => new Date(t * 1000).toLocaleTimeString();
/** Tokens per second: one decimal below 100, none above. */
export const perSecond = (x) => x.toFixed(x < 100 ? 1 : 0);
/** `text` cut to `max` characters with an ellipsis (the drawings have fixed-width boxes). */
export const clip = (text, max) => (text.length > max ? `${text.slice(0, max - 1)}…` : text);
