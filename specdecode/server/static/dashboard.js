// The specdecode dashboard: polls dashboard/data (the numbers /metrics shows, as JSON), keeps a rolling window of
// snapshots, turns the counters into rates between snapshots and draws them on canvases. No libraries.
"use strict";

const PREFIX = "specdecode:";
const COLORS = ["#2563eb", "#dc6803", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04"];
let config = { poll_seconds: 0.25, window_seconds: 120, rate_seconds: 2 };
// ?window=SECONDS draws a shorter or longer history than the server's default.
const overrides = {};
const asked = Number(new URLSearchParams(window.location.search).get("window"));
if (asked > 0) overrides.window_seconds = asked;
const snapshots = []; // {t, samples}, oldest first, spanning the window
const points = []; // the figures derived at each poll, oldest first
let polls = 0;

// -- reading the samples ---------------------------------------------------------------------------------------

function sample(samples, name) {
  return samples[PREFIX + name] || 0;
}

// {label value: sample} for one label of a labelled metric.
function byLabel(samples, name, label) {
  const out = {};
  const head = PREFIX + name + "{";
  for (const [key, v] of Object.entries(samples)) {
    if (!key.startsWith(head)) continue;
    const m = key.slice(head.length).match(new RegExp(label + '="([^"]*)"'));
    if (m) out[m[1]] = v;
  }
  return out;
}

function ratio(num, den) {
  return den > 0 ? num / den : null;
}

// The figures between two snapshots (a older than b): rates, and means per step.
function derive(a, b) {
  const dt = b.t - a.t;
  const d = (name) => sample(b.samples, name) - sample(a.samples, name);
  const steps = d("spec_decode_verify_time_seconds_count");
  const acceptance = {};
  const drafted = byLabel(b.samples, "spec_decode_num_draft_tokens_by_method_total", "method");
  const accepted = byLabel(b.samples, "spec_decode_num_accepted_tokens_by_method_total", "method");
  const draftedBefore = byLabel(a.samples, "spec_decode_num_draft_tokens_by_method_total", "method");
  const acceptedBefore = byLabel(a.samples, "spec_decode_num_accepted_tokens_by_method_total", "method");
  for (const method of Object.keys(drafted)) {
    acceptance[method] = ratio((accepted[method] || 0) - (acceptedBefore[method] || 0),
                               drafted[method] - (draftedBefore[method] || 0));
  }
  return {
    t: b.t,
    tokens: d("generation_tokens_total") / dt,
    prompt: d("prompt_tokens_total") / dt,
    speedup: ratio(d("spec_decode_plain_equivalent_seconds_total"), d("spec_decode_actual_seconds_total")),
    acceptance,
    overallAcceptance: ratio(d("spec_decode_num_accepted_tokens_total"), d("spec_decode_num_draft_tokens_total")),
    perStep: ratio(d("spec_decode_num_emitted_tokens_total"), d("spec_decode_num_drafts_total")),
    draftMs: ratio(1000 * d("spec_decode_draft_time_seconds_sum"), steps),
    verifyMs: ratio(1000 * d("spec_decode_verify_time_seconds_sum"), steps),
    batch: ratio(d("decode_batch_size_sum"), d("decode_batch_size_count")),
    ttftMs: ratio(1000 * d("time_to_first_token_seconds_sum"), d("time_to_first_token_seconds_count")),
    itlMs: ratio(1000 * d("inter_token_latency_seconds_sum"), d("inter_token_latency_seconds_count")),
    running: sample(b.samples, "num_requests_running"),
    waiting: sample(b.samples, "num_requests_waiting"),
    kv: 100 * sample(b.samples, "kv_cache_usage_perc"),
    prefixHits: ratio(100 * d("prefix_cache_hits_total"), d("prefix_cache_queries_total")),
    preemptions: d("num_preemptions_total") * 60 / dt,
    blocksUsed: sample(b.samples, "kv_cache_blocks_used"),
    blocksCached: sample(b.samples, "kv_cache_blocks_cached"),
  };
}

// Acceptance at each draft position between two snapshots (a = null: since the server started).
function positionAcceptance(a, b) {
  const acc = byLabel(b.samples, "spec_decode_num_accepted_tokens_per_pos_total", "position");
  const drafted = byLabel(b.samples, "spec_decode_num_drafts_per_pos_total", "position");
  const accBefore = a ? byLabel(a.samples, "spec_decode_num_accepted_tokens_per_pos_total", "position") : {};
  const draftedBefore = a ? byLabel(a.samples, "spec_decode_num_drafts_per_pos_total", "position") : {};
  const positions = Object.keys(drafted).map(Number).sort((x, y) => x - y);
  return positions.map((p) => ratio((acc[p] || 0) - (accBefore[p] || 0), drafted[p] - (draftedBefore[p] || 0)));
}

// -- keeping the window ----------------------------------------------------------------------------------------

function add(data) {
  const snap = { t: data.time, samples: data.samples };
  const last = snapshots[snapshots.length - 1];
  if (last && sample(snap.samples, "generation_tokens_total") < sample(last.samples, "generation_tokens_total")) {
    snapshots.length = 0; // the server restarted: its counters began again
    points.length = 0;
  }
  if (last && snap.t <= last.t) return;
  snapshots.push(snap);
  // Rates over at least rate_seconds, from the newest snapshot at least that old (else the oldest one).
  let base = snapshots[0];
  for (const s of snapshots) {
    if (snap.t - s.t >= config.rate_seconds) base = s;
    else break;
  }
  if (base !== snap) points.push(derive(base, snap));
  const oldest = snap.t - config.window_seconds;
  while (snapshots.length > 2 && snapshots[1].t < oldest) snapshots.shift();
  while (points.length && points[0].t < oldest) points.shift();
}

// -- drawing ---------------------------------------------------------------------------------------------------

function fmt(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "\u2013";
  return v.toFixed(digits);
}

function setup(canvas) {
  const ratioPx = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratioPx) || canvas.height !== Math.round(h * ratioPx)) {
    canvas.width = Math.round(w * ratioPx);
    canvas.height = Math.round(h * ratioPx);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratioPx, 0, 0, ratioPx, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h, left: 44, right: w - 8, top: 22, bottom: h - 18 };
}

// The smallest of 1, 2, 4, 8 or 10 times a power of ten that is at least v: its quarters read well as ticks.
function niceMax(v) {
  if (!(v > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 4, 8, 10]) if (m * step >= v * (1 - 1e-9)) return m * step;
  return 10 * step;
}

function yAxis(g, yMax) {
  const { ctx } = g;
  ctx.strokeStyle = "#eef0f3";
  ctx.fillStyle = "#667085";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = g.bottom - (i / 4) * (g.bottom - g.top);
    ctx.beginPath();
    ctx.moveTo(g.left, y);
    ctx.lineTo(g.right, y);
    ctx.stroke();
    ctx.fillText(String(+((yMax * i) / 4).toFixed(3)), g.left - 4, y);
  }
}

function legend(g, series) {
  const { ctx } = g;
  let x = g.left;
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  for (const s of series) {
    const text = `${s.name} ${fmt(s.latest, s.digits)}`;
    ctx.fillStyle = s.color;
    ctx.fillRect(x, 6, 10, 10);
    ctx.fillStyle = "#1d2330";
    ctx.fillText(text, x + 14, 11);
    x += 24 + ctx.measureText(text).width;
  }
}

// series: [{name, color, get(point) -> number | null, digits}]; gaps where a value is null.
function lineChart(canvas, series, opts) {
  const g = setup(canvas);
  const { ctx } = g;
  const t1 = points.length ? points[points.length - 1].t : 0;
  const t0 = t1 - config.window_seconds;
  let top = 0;
  for (const s of series) for (const p of points) { const v = s.get(p); if (v !== null && v > top) top = v; }
  const yMax = opts.fixed ? opts.max : niceMax(Math.max(opts.max || 0, top));
  yAxis(g, yMax);
  ctx.fillStyle = "#667085";
  ctx.textBaseline = "alphabetic";
  ctx.textAlign = "left";
  ctx.fillText(`-${config.window_seconds} s`, g.left, g.h - 4);
  ctx.textAlign = "right";
  ctx.fillText("now", g.right, g.h - 4);
  const x = (t) => g.left + ((t - t0) / (t1 - t0)) * (g.right - g.left);
  const y = (v) => g.bottom - (Math.min(v, yMax) / yMax) * (g.bottom - g.top);
  if (opts.reference !== undefined) {
    ctx.strokeStyle = "#98a2b3";
    ctx.setLineDash([4, 4]);
    ctx.beginPath();
    ctx.moveTo(g.left, y(opts.reference));
    ctx.lineTo(g.right, y(opts.reference));
    ctx.stroke();
    ctx.setLineDash([]);
  }
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.8;
    ctx.beginPath();
    let drawing = false;
    s.latest = null;
    for (const p of points) {
      const v = s.get(p);
      if (v === null || v === undefined || !isFinite(v)) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(p.t), y(v)); else ctx.moveTo(x(p.t), y(v));
      drawing = true;
      s.latest = v;
    }
    ctx.stroke();
    ctx.lineWidth = 1;
  }
  legend(g, series.map((s) => ({ ...s, digits: s.digits === undefined ? opts.digits || 0 : s.digits })));
}

// Label every n-th of `count` slots `slot` pixels wide so that labels `width` pixels wide never overlap.
function labelStride(count, slot, width) {
  let every = 1;
  while (every < count && every * slot < width) every += 1;
  return every;
}

function positionChart(canvas) {
  const g = setup(canvas);
  const { ctx } = g;
  const newest = snapshots[snapshots.length - 1];
  const recent = newest ? positionAcceptance(snapshots[0] === newest ? null : snapshots[0], newest) : [];
  const total = newest ? positionAcceptance(null, newest) : [];
  yAxis(g, 100);
  const n = Math.max(total.length, 1);
  const slot = (g.right - g.left) / n;
  ctx.textAlign = "center";
  ctx.textBaseline = "alphabetic";
  for (let i = 0; i < total.length; i++) {
    const x = g.left + i * slot + slot * 0.2, w = slot * 0.6;
    const h = (v) => (v || 0) * (g.bottom - g.top);
    if (recent[i] !== null && recent[i] !== undefined) {
      ctx.fillStyle = COLORS[0];
      ctx.fillRect(x, g.bottom - h(recent[i]), w, h(recent[i]));
    }
    if (total[i] !== null) {
      ctx.strokeStyle = "#1d2330";
      ctx.strokeRect(x, g.bottom - h(total[i]), w, h(total[i]));
    }
  }
  // Under the bars, the position numbers: every one that fits without touching its neighbour (with K = 8 and more
  // positions, "pos i: a%" labels ran into each other); the window's percentages above the bars where they fit.
  ctx.fillStyle = "#667085";
  const every = labelStride(total.length, slot, ctx.measureText(String(total.length - 1)).width + 6);
  for (let i = 0; i < total.length; i += every) ctx.fillText(String(i), g.left + (i + 0.5) * slot, g.h - 4);
  const widest = ctx.measureText("100%").width + 4;
  if (widest <= slot) {
    for (let i = 0; i < total.length; i++) {
      if (recent[i] === null || recent[i] === undefined) continue;
      const top = g.bottom - (recent[i] || 0) * (g.bottom - g.top);
      ctx.fillText(`${fmt(100 * recent[i], 0)}%`, g.left + (i + 0.5) * slot, Math.max(g.top + 10, top - 3));
    }
  }
  ctx.textAlign = "left";
  ctx.fillText("draft position", g.left, 11);
  if (!total.length) {
    ctx.fillStyle = "#667085";
    ctx.fillText("no drafts yet", (g.left + g.right) / 2, (g.top + g.bottom) / 2);
  }
}

function methodSeries() {
  const methods = new Set();
  for (const p of points) for (const m of Object.keys(p.acceptance)) methods.add(m);
  return [...methods].sort().map((m, i) => ({
    name: m, color: COLORS[i % COLORS.length], get: (p) => (p.acceptance[m] === undefined ? null : 100 * p.acceptance[m]),
  }));
}

function draw() {
  lineChart(document.getElementById("chart-tokens"), [
    { name: "generated", color: COLORS[0], get: (p) => p.tokens, digits: 1 },
    { name: "prompt", color: COLORS[1], get: (p) => p.prompt, digits: 1 },
  ], { digits: 0 });
  lineChart(document.getElementById("chart-speedup"), [
    { name: "speedup", color: COLORS[2], get: (p) => p.speedup, digits: 2 },
  ], { digits: 1, max: 2, reference: 1 });
  lineChart(document.getElementById("chart-acceptance"), methodSeries(), { digits: 0, max: 100, fixed: true });
  positionChart(document.getElementById("chart-positions"));
  lineChart(document.getElementById("chart-times"), [
    { name: "draft", color: COLORS[1], get: (p) => p.draftMs, digits: 1 },
    { name: "verify", color: COLORS[0], get: (p) => p.verifyMs, digits: 1 },
  ], { digits: 0 });
  lineChart(document.getElementById("chart-batch"), [
    { name: "batch", color: COLORS[0], get: (p) => p.batch, digits: 1 },
    { name: "running", color: COLORS[2], get: (p) => p.running },
    { name: "queued", color: COLORS[4], get: (p) => p.waiting },
  ], { digits: 0, max: config.max_num_seqs || 1 });
  lineChart(document.getElementById("chart-latency"), [
    { name: "first token", color: COLORS[5], get: (p) => p.ttftMs },
    { name: "between tokens", color: COLORS[3], get: (p) => p.itlMs },
  ], { digits: 0 });
  lineChart(document.getElementById("chart-kv"), [
    { name: "KV use %", color: COLORS[3], get: (p) => p.kv, digits: 1 },
    { name: "prefix hits %", color: COLORS[2], get: (p) => p.prefixHits, digits: 1 },
    { name: "preemptions/min", color: COLORS[5], get: (p) => p.preemptions, digits: 1 },
  ], { digits: 0, max: 100, fixed: true });
}

function tiles() {
  const p = points[points.length - 1];
  if (!p) return;
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  set("tile-tokens", fmt(p.tokens, 1));
  set("tile-speedup", p.speedup === null ? "\u2013" : `${fmt(p.speedup, 2)}\u00d7`);
  set("tile-acceptance", p.overallAcceptance === null ? "\u2013" : `${fmt(100 * p.overallAcceptance, 0)}%`);
  set("tile-per-step", fmt(p.perStep, 2));
  set("tile-batch", fmt(p.batch, 1));
  set("tile-queue", fmt(p.waiting, 0));
  set("tile-kv", `${fmt(p.kv, 1)}%`);
  set("tile-blocks", `${fmt(p.blocksUsed, 0)} + ${fmt(p.blocksCached, 0)}`);
}

// -- polling ---------------------------------------------------------------------------------------------------

function status(text, error) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.classList.toggle("error", Boolean(error));
  el.dataset.polls = String(polls);
  const p = points[points.length - 1];
  el.dataset.tokensPerSecond = p ? String(p.tokens) : "";
  if (error) el.dataset.error = text; else delete el.dataset.error;
}

// A server started with an API key guards dashboard/data: open the page as /dashboard#key=KEY (a fragment never
// leaves the browser, so the key reaches no log) and the page sends it as a bearer token.
const apiKey = new URLSearchParams(globalThis.location ? location.hash.slice(1) : "").get("key");
const authHeaders = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};

async function poll() {
  try {
    const response = await fetch("dashboard/data", { cache: "no-store", headers: authHeaders });
    if (response.status === 401) throw new Error("the server has an API key: open this page as /dashboard#key=KEY");
    if (!response.ok) throw new Error(`dashboard/data answered ${response.status}`);
    const data = await response.json();
    config = { ...config, ...data, ...overrides };
    polls += 1;
    add(data);
    document.getElementById("model").textContent =
      `${data.model} \u00b7 speculation: ${data.method} \u00b7 ${data.max_num_seqs} slots \u00d7 ${data.max_model_len} positions`;
    tiles();
    draw();
    status(`updated ${new Date(data.time * 1000).toLocaleTimeString()} \u00b7 ${polls} polls`, false);
  } catch (err) {
    status(`no data: ${err.message}`, true);
  }
  setTimeout(poll, config.poll_seconds * 1000);
}

window.addEventListener("resize", draw);
poll();
