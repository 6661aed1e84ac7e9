// Building SVG in the page: one element helper, the namespace in one place. Text goes in as text, never markup.
// Imports nothing.

const NS = "http://www.w3.org/2000/svg"; // a name, not an address: nothing is fetched from it

/** An SVG element with attributes and children, nested arrays flattened (strings become text nodes; null and
 * undefined are skipped). */
export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children.flat(Infinity)) if (child !== null && child !== undefined) node.append(child);
  return node;
}

/** A `<title>`: the tooltip of its parent and its name for screen readers. */
export const title = (text) => svg("title", {}, text);
