// The capacity panel (polls /v1/stats: per pool used / evictable / pinned / free blocks over the last
// minutes, and the last requests' required vs peak blocks) and the plan panel (POST /v1/plan).
"use strict";

const HISTORY_S = 300;
const POLL_MS = 1000;
const history = [];  // {time, pools}
let latestStats = null;

// A pool's blocks split four ways: held by requests (used), held by pinned prefixes (pinned), cached
// but evictable, and free. free_blocks counts the evictable ones too (what an allocation can take).
function poolParts(pool) {
  const free = pool.free_blocks - (pool.evictable_blocks || 0);
  return {used: pool.total_blocks - pool.free_blocks - (pool.pinned_blocks || 0),
          pinned: pool.pinned_blocks || 0, evictable: pool.evictable_blocks || 0, free};
}

function cell(row, text, attributes = {}) {
  const td = document.createElement("td");
  td.textContent = text;
  for (const [key, value] of Object.entries(attributes)) td.setAttribute(key, value);
  row.appendChild(td);
  return td;
}

function drawPoolChart(svg, name) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  // A fixed drawing box stretched to the panel (drawn while hidden too, when the panel has no size).
  const width = 1000;
  const height = 140;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  if (!history.length) return;
  const now = history[history.length - 1].time;
  // the time axis spans the history kept so far (at least 30 s), up to HISTORY_S
  const span = Math.min(HISTORY_S, Math.max(30, now - history[0].time));
  const x = (t) => width - ((now - t) / span) * width;
  svg.dataset.spanSeconds = String(Math.round(span));
  const total = Math.max(1, history[history.length - 1].pools[name].total_blocks);
  const y = (blocks) => height - (blocks / total) * height;
  const order = ["used", "pinned", "evictable", "free"];
  const points = history.filter((h) => h.pools[name]).map((h) => ({t: h.time, parts: poolParts(h.pools[name])}));
  let below = points.map(() => 0);
  for (const part of order) {
    const above = points.map((p, i) => below[i] + p.parts[part]);
    const top = points.map((p, i) => `${x(p.t).toFixed(1)},${y(above[i]).toFixed(1)}`);
    const bottom = points.map((p, i) => `${x(p.t).toFixed(1)},${y(below[i]).toFixed(1)}`).reverse();
    if (points.length === 1) {  // one sample: a thin band
      top.unshift(`${(x(points[0].t) - 4).toFixed(1)},${y(above[0]).toFixed(1)}`);
      bottom.push(`${(x(points[0].t) - 4).toFixed(1)},${y(below[0]).toFixed(1)}`);
    }
    const polygon = document.createElementNS("http://www.w3.org/2000/svg", "polygon");
    polygon.setAttribute("points", top.concat(bottom).join(" "));
    polygon.setAttribute("class", part);
    svg.appendChild(polygon);
    below = above;
  }
}

function renderCapacity(stats) {
  const container = document.getElementById("pools");
  for (const [name, pool] of Object.entries(stats.pools)) {
    let box = container.querySelector(`.pool[data-pool="${CSS.escape(name)}"]`);
    if (!box) {
      box = document.createElement("div");
      box.className = "pool";
      box.dataset.pool = name;
      box.innerHTML = `<h3></h3><table><thead><tr><th>total</th><th>used</th><th>pinned</th><th>evictable</th>
        <th>free (incl. evictable)</th></tr></thead><tbody><tr></tr></tbody></table>
        <svg class="chart" xmlns="http://www.w3.org/2000/svg"></svg>
        <div class="muted">blue used, purple pinned, amber evictable, grey free</div>`;
      box.querySelector("h3").textContent = `pool ${name}` + (pool.kind ? ` (${pool.kind})` : "");
      container.appendChild(box);
    }
    const row = box.querySelector("tbody tr");
    row.innerHTML = "";
    const parts = poolParts(pool);
    cell(row, pool.total_blocks, {"data-field": "total_blocks"});
    cell(row, parts.used, {"data-field": "used_blocks"});
    cell(row, pool.pinned_blocks, {"data-field": "pinned_blocks"});
    cell(row, pool.evictable_blocks, {"data-field": "evictable_blocks"});
    cell(row, pool.free_blocks, {"data-field": "free_blocks"});
    drawPoolChart(box.querySelector("svg"), name);
    const span = box.querySelector("svg").dataset.spanSeconds;
    box.querySelector(".muted").textContent = `last ${span} s: blue used, purple pinned, amber evictable, ` +
      `grey free (of ${pool.total_blocks} blocks)`;
  }
  const body = document.querySelector("#recent tbody");
  body.innerHTML = "";
  const recent = (stats.recent_requests || []).slice().reverse();
  for (const request of recent) {
    for (const [pool, required] of Object.entries(request.required_blocks)) {
      const peak = request.peak_blocks[pool] || 0;
      const row = document.createElement("tr");
      row.dataset.request = request.request_id;
      row.dataset.pool = pool;
      cell(row, request.request_id.slice(0, 24));
      cell(row, request.beam_width);
      cell(row, pool);
      cell(row, required, {"data-field": "required_blocks"});
      cell(row, peak, {"data-field": "peak_blocks"});
      const bars = cell(row, "");
      const scale = 200 / Math.max(1, required, peak);
      bars.innerHTML = `<span class="bar required" style="width:${required * scale}px"></span>` +
                       `<span class="bar" style="width:${peak * scale}px"></span>`;
      body.appendChild(row);
    }
  }
}

async function pollStats() {
  try {
    const response = await api("/v1/stats");
    if (response.ok) {
      const stats = await response.json();
      latestStats = stats;
      history.push({time: stats.time, pools: stats.pools});
      while (history.length && stats.time - history[0].time > HISTORY_S) history.shift();
      renderCapacity(stats);
      document.body.dataset.statsPolls = String(Number(document.body.dataset.statsPolls || 0) + 1);
    }
  } catch (error) { /* the server may be restarting: try again on the next tick */ }
}

function startCapacity() {
  document.getElementById("history-minutes").textContent = String(HISTORY_S / 60);
  pollStats();
  setInterval(pollStats, POLL_MS);
}

function planCell(row, text, header = false) {
  const element = document.createElement(header ? "th" : "td");
  element.textContent = text;
  row.appendChild(element);
}

function renderPlan(plan) {
  const out = document.getElementById("plan-result");
  const fits = plan.fits ? "fits" : "does not fit";
  out.innerHTML = `<p id="plan-verdict" class="${plan.fits ? "fits" : "nofit"}"></p><table id="plan-pools"></table>`;
  document.getElementById("plan-verdict").textContent =
    `${plan.model}, width ${plan.request.beam_width}, ${plan.request.prompt_len} + ${plan.request.max_new_tokens} ` +
    `tokens: ${fits}; ${plan.max_concurrent_requests} such requests at once; max_seq_len ${plan.max_seq_len}; ` +
    `KV cache ${(plan.kv_cache_bytes / 2 ** 30).toFixed(2)} GiB. A per-beam copy (naive) needs ` +
    `${plan.naive.required_blocks} blocks: ${plan.naive.fits ? "fits" : "does not fit"}, ` +
    `${plan.naive.max_concurrent_requests} at once.`;
  const table = document.getElementById("plan-pools");
  const head = document.createElement("tr");
  for (const title of ["pool", "kind", "required blocks", "capacity blocks", "fits", "requests at once"]) {
    planCell(head, title, true);
  }
  table.appendChild(head);
  for (const pool of plan.pools) {
    const row = document.createElement("tr");
    row.dataset.pool = pool.name;
    for (const value of [pool.name, pool.kind, pool.required_blocks, pool.capacity_blocks, pool.fits ? "yes" : "no",
                         pool.max_concurrent_requests]) planCell(row, value);
    table.appendChild(row);
  }
}

async function submitPlan(event) {
  event.preventDefault();
  const error = document.getElementById("plan-error");
  error.hidden = true;
  const body = {model: document.getElementById("plan-model").value,
                memory: document.getElementById("plan-memory").value,
                beam_width: Number(document.getElementById("plan-width").value),
                prompt_len: Number(document.getElementById("plan-prompt-len").value),
                max_new_tokens: Number(document.getElementById("plan-max-new-tokens").value),
                dtype: document.getElementById("plan-dtype").value};
  const response = await api("/v1/plan", {method: "POST", headers: {"Content-Type": "application/json"},
                                            body: JSON.stringify(body)});
  const answer = await response.json();
  if (!response.ok) {
    error.textContent = (answer.error && answer.error.message) || `error ${response.status}`;
    error.hidden = false;
    document.getElementById("plan-result").innerHTML = "";
    return;
  }
  renderPlan(answer);
}

window.widebeamPanels = {startCapacity, submitPlan, poolParts, latest: () => latestStats};
