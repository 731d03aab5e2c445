// The search tree as SVG, drawn from a `return_tree` tree (docs/ui.md: one list per field, index =
// node id). One column per step; within a column, children follow their parent's order, best
// cumulative log-prob first. Pruned nodes (and branches with nothing kept after them) are greyed,
// finished hypotheses marked, returned ones labelled with their rank; hovering shows token and score.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

// Every call of the page goes to this server by its origin: a page opened as http://user:key@host/
// (the API key as Basic credentials) must not put them in a fetch URL, which browsers refuse; the
// browser sends the credentials it was given for the page with each same-origin call.
function api(path, options) {
  return fetch(new URL(path, window.location.origin).href, options);
}
const COLUMN_PX = 96;
const ROW_PX = 18;
const MARGIN_PX = 30;

function svgElement(name, attributes, parent) {
  const element = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (parent) parent.appendChild(element);
  return element;
}

function tokenText(tree, node) {
  const id = tree.token_id[node];
  const text = (tree.token_text || {})[String(id)];
  return text === undefined ? `#${id}` : text;
}

// Whether each node leads to something kept at the end: a returned hypothesis, or a beam still live.
function aliveNodes(tree) {
  const alive = new Array(tree.num_nodes).fill(false);
  for (let node = tree.num_nodes - 1; node >= 0; node--) {
    const endsLive = tree.pruned_at[node] === null && !tree.finished[node] && !alive[node]
      && tree.step[node] === tree.num_steps;
    if (tree.rank[node] !== null || endsLive) alive[node] = true;
    if (alive[node] && tree.parent[node] >= 0) alive[tree.parent[node]] = true;
  }
  return alive;
}

function layoutTree(tree) {
  const children = Array.from({length: tree.num_nodes}, () => []);
  const roots = [];
  for (let node = 0; node < tree.num_nodes; node++) {
    (tree.parent[node] < 0 ? roots : children[tree.parent[node]]).push(node);
  }
  const byScore = (a, b) => tree.cumulative_logprob[b] - tree.cumulative_logprob[a];
  const columns = [];  // columns[step] = nodes in drawing order
  let level = roots.sort(byScore);
  while (level.length) {
    columns.push(level);
    level = level.flatMap((node) => children[node].sort(byScore));
  }
  const position = new Array(tree.num_nodes);
  columns.forEach((nodes, column) => nodes.forEach((node, row) => {
    position[node] = {x: MARGIN_PX + (column + 1) * COLUMN_PX, y: MARGIN_PX + row * ROW_PX};
  }));
  const rows = Math.max(1, ...columns.map((nodes) => nodes.length));
  return {position, width: MARGIN_PX * 2 + (columns.length + 1) * COLUMN_PX, height: MARGIN_PX * 2 + rows * ROW_PX};
}

function describeNode(tree, node) {
  const lines = [`token ${JSON.stringify(tokenText(tree, node))} (id ${tree.token_id[node]})`,
                 `step ${tree.step[node]}, cumulative log-prob ${tree.cumulative_logprob[node].toFixed(4)}`];
  if (tree.finished[node]) lines.push(`finished (${tree.finish_reason[node]}), score ${tree.score[node].toFixed(4)}`);
  if (tree.rank[node] !== null) lines.push(`returned #${tree.rank[node] + 1}`);
  if (tree.pruned_at[node] !== null) lines.push(`pruned at step ${tree.pruned_at[node]}`);
  return lines.join("\n");
}

function drawTree(svg, tree, tip) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const {position, width, height} = layoutTree(tree);
  const alive = aliveNodes(tree);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const rootY = MARGIN_PX;
  svgElement("circle", {cx: MARGIN_PX + 12, cy: rootY, r: 6, class: "node root"}, svg);
  svgElement("text", {x: MARGIN_PX, y: rootY - 10}, svg).textContent = "prompt";
  for (let step = 1; step <= tree.num_steps; step++) {
    svgElement("text", {x: MARGIN_PX + step * COLUMN_PX - 12, y: 12, class: "step-label"}, svg)
      .textContent = `step ${step}`;
  }
  const edges = svgElement("g", {}, svg);
  const nodes = svgElement("g", {}, svg);
  for (let node = 0; node < tree.num_nodes; node++) {
    const {x, y} = position[node];
    const parent = tree.parent[node];
    const from = parent < 0 ? {x: MARGIN_PX + 12, y: rootY} : position[parent];
    const midX = (from.x + x) / 2;
    const dead = alive[node] ? "" : " dead";
    svgElement("path", {d: `M${from.x},${from.y} C${midX},${from.y} ${midX},${y} ${x},${y}`,
                        class: "edge" + dead}, edges);
    let kind = "live";
    if (tree.rank[node] !== null) kind = "ranked";
    else if (tree.finished[node]) kind = "finished";
    else if (tree.pruned_at[node] !== null) kind = "pruned";
    const circle = svgElement("circle", {cx: x, cy: y, r: 5, class: `node ${kind}${dead}`,
      "data-node": node, "data-step": tree.step[node],
      "data-pruned-at": tree.pruned_at[node] === null ? "" : tree.pruned_at[node],
      "data-finished": tree.finished[node] ? "true" : "false",
      "data-rank": tree.rank[node] === null ? "" : tree.rank[node]}, nodes);
    svgElement("title", {}, circle).textContent = describeNode(tree, node);
    const label = svgElement("text", {x: x + 8, y: y + 3, class: dead.trim()}, nodes);
    if (tree.rank[node] !== null) {  // the rank first, in bold, then the token
      svgElement("tspan", {class: "rank"}, label).textContent = `#${tree.rank[node] + 1} `;
    }
    label.appendChild(document.createTextNode(tokenText(tree, node).slice(0, 10)));
    if (tip) {
      circle.addEventListener("mouseenter", (event) => {
        tip.textContent = describeNode(tree, node);
        tip.style.left = `${event.clientX + 12}px`;
        tip.style.top = `${event.clientY + 12}px`;
        tip.hidden = false;
      });
      circle.addEventListener("mouseleave", () => { tip.hidden = true; });
    }
  }
  const pruned = tree.pruned_at.filter((p) => p !== null).length;
  return `${tree.num_nodes} kept candidates over ${tree.num_steps} steps, ${pruned} pruned, ` +
         `width ${tree.beam_width}, ${tree.nbytes} bytes`;
}

window.widebeamTree = {drawTree, layoutTree, aliveNodes};
