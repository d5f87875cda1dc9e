// The engine dashboard: polls GET /stats (JSON derived from the /metrics counters) every second, keeps the last
// five minutes of points, and draws tiles, SVG charts and the engine configuration.

import { apiFetch, el, errorMessage, wireKeyButton } from "./api.js";
import { LineChart } from "./charts.js";

const POLL_MS = 1000;
const SPAN_S = 300;
const $ = (id) => document.getElementById(id);

const num = (v, digits = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const int = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(v >= 0.1 || v === 0 ? 0 : 1)}%`);
const secs = (v) => {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  return v >= 1 ? `${v.toFixed(2)} s` : `${(v * 1000).toFixed(v >= 0.01 ? 0 : 1)} ms`;
};
const rate = (v) => (v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));

const CHARTS = [
  { id: "requests", title: "Requests", format: (v) => num(v, 0), yMax: null, integer: true,
    series: [{ key: "num_requests_running", label: "running", color: "var(--c1)" },
             { key: "num_requests_waiting", label: "waiting", color: "var(--c2)" }] },
  { id: "kv", title: "KV cache", format: pct, yMax: 1,
    series: [{ key: "kv_cache_usage_perc", label: "usage", color: "var(--c1)" },
             { key: "prefix_cache_hit_rate", label: "prefix-cache hit rate", color: "var(--c3)" }] },
  { id: "throughput", title: "Throughput (tokens/s)", format: rate, yMax: null,
    series: [{ key: "generation_tokens_per_s", label: "generation", color: "var(--c1)" },
             { key: "prompt_tokens_per_s", label: "prompt", color: "var(--c2)" }] },
  { id: "ttft", title: "Time to first token (last 10 s)", format: secs, yMax: null,
    series: [{ key: "ttft_p50_s", label: "P50", color: "var(--c1)" },
             { key: "ttft_p99_s", label: "P99", color: "var(--c4)" }] },
  { id: "itl", title: "Inter-token latency (last 10 s)", format: secs, yMax: null,
    series: [{ key: "itl_p50_s", label: "P50", color: "var(--c1)" },
             { key: "itl_p99_s", label: "P99", color: "var(--c4)" }] },
  { id: "preemptions", title: "Preemptions (cumulative)", format: (v) => num(v, 0), yMax: null, integer: true,
    series: [{ key: "num_preemptions", label: "preemptions", color: "var(--c2)" }] },
];

const TILES = [
  ["running", "Running requests"], ["waiting", "Waiting requests"], ["kv", "KV cache usage"],
  ["hit", "Prefix-cache hit rate"], ["gen", "Generation tok/s"], ["prompt", "Prompt tok/s"],
  ["ttft", "TTFT P50 / P99"], ["itl", "ITL P50 / P99"], ["preempt", "Preemptions"], ["finished", "Finished requests"],
];

const store = { times: [], data: {}, since: null, charts: [], tiles: {} };

function buildPage() {
  for (const [id, label] of TILES) {
    const value = el("div", { class: "value", id: `tile-${id}`, text: "–" });
    const sub = el("div", { class: "sub", id: `tile-${id}-sub` });
    $("tiles").append(el("div", { class: "tile" }, el("div", { class: "label", text: label }), value, sub));
    store.tiles[id] = [value, sub];
  }
  for (const spec of CHARTS) {
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.id = `chart-${spec.id}`;
    const legend = el("div", { class: "legend" });
    $("charts").append(el("div", { class: "card", dataset: { chart: spec.id } }, el("h3", { text: spec.title }), svg, legend));
    store.charts.push(new LineChart(svg, legend, { series: spec.series, format: spec.format, yMax: spec.yMax,
                                                spanS: SPAN_S, integer: !!spec.integer }));
    for (const s of spec.series) store.data[s.key] = [];
  }
}

function tile(id, value, sub = "") {
  const [v, s] = store.tiles[id];
  v.textContent = value;
  s.textContent = sub;
}

function showConfig(cfg) {
  const rows = [
    ["model", cfg.served_model_name], ["path", cfg.model], ["architecture", cfg.architecture], ["dtype", cfg.dtype],
    ["quantization", cfg.quantization || "none"], ["ISA level", cfg.isa || "unknown"],
    ["KV blocks", `${int(cfg.num_kv_blocks)} × ${cfg.block_size} tokens (${int(cfg.kv_cache_tokens)} tokens)`],
    ["max_num_seqs", int(cfg.max_num_seqs)], ["max_num_batched_tokens", int(cfg.max_num_batched_tokens)],
    ["long_prefill_token_threshold", cfg.long_prefill_token_threshold ? int(cfg.long_prefill_token_threshold) : "off"],
    ["max_model_len", int(cfg.max_model_len)], ["prefix caching", cfg.enable_prefix_caching ? "on" : "off"],
    ["parallel", `TP ${cfg.tensor_parallel_size} × PP ${cfg.pipeline_parallel_size}`],
    ["engine", cfg.engine_mode || "–"], ["version", cfg.version || "–"],
  ];
  $("config").replaceChildren(...rows.map(([k, v]) =>
    el("tr", { dataset: { key: k } }, el("td", { text: k }), el("td", { text: String(v) }))));
  $("model-name").textContent = cfg.served_model_name;
}

function merge(stats) {
  const s = stats.series;
  for (let i = 0; i < s.time.length; i++) {
    store.times.push(s.time[i]);
    for (const key of Object.keys(store.data)) store.data[key].push(s[key] ? s[key][i] : null);
  }
  if (s.time.length) store.since = s.time[s.time.length - 1];
  const cut = stats.time - SPAN_S - 5;
  let drop = 0;
  while (drop < store.times.length && store.times[drop] < cut) drop++;
  if (drop) {
    store.times.splice(0, drop);
    for (const key of Object.keys(store.data)) store.data[key].splice(0, drop);
  }
}

function showStats(stats) {
  if (stats.config) showConfig(stats.config);
  const c = stats.current;
  const t = stats.totals;
  if (c) {
    tile("running", int(c.num_requests_running), `in flight at the server: ${int(stats.num_requests_in_flight)}`);
    tile("waiting", int(c.num_requests_waiting));
    tile("kv", pct(c.kv_cache_usage_perc), stats.config ? `of ${int(stats.config.kv_cache_tokens)} tokens` : "");
    tile("hit", pct(c.prefix_cache_hit_rate), `all time: ${pct(t.prefix_cache_hit_rate)}`);
    tile("gen", rate(c.generation_tokens_per_s), `total ${int(t.generation_tokens)} tokens`);
    tile("prompt", rate(c.prompt_tokens_per_s), `total ${int(t.prompt_tokens)} tokens`);
    tile("ttft", `${secs(c.ttft_p50_s)} / ${secs(c.ttft_p99_s)}`, `all time: ${secs(t.ttft_p50_s)} / ${secs(t.ttft_p99_s)}`);
    tile("itl", `${secs(c.itl_p50_s)} / ${secs(c.itl_p99_s)}`, `all time: ${secs(t.itl_p50_s)} / ${secs(t.itl_p99_s)}`);
    tile("preempt", int(t.num_preemptions));
    const rs = t.request_success || {};
    const total = Object.values(rs).reduce((a, b) => a + b, 0);
    tile("finished", int(total), Object.entries(rs).map(([k, v]) => `${k} ${int(v)}`).join(" · "));
  }
  for (const chart of store.charts) chart.update(store.times, store.data, stats.time);
}

let paused = false; // a 401 the user cancelled: wait for the API key button

async function poll() {
  const status = $("status");
  try {
    const q = store.since !== null ? `?since=${encodeURIComponent(store.since)}` : "";
    const r = await apiFetch(`/stats${q}`);
    if (r.status === 401) {
      paused = true;
      status.className = "status bad";
      status.textContent = `/stats needs the server's API key: ${await errorMessage(r)} Use the API key button.`;
      return;
    }
    if (!r.ok) throw new Error(await errorMessage(r));
    const stats = await r.json();
    merge(stats);
    showStats(stats);
    status.className = "status";
    status.textContent = `updated ${new Date(stats.time * 1000).toLocaleTimeString()} · every ${POLL_MS / 1000} s · ` +
      `uptime ${Math.round(stats.uptime_s)} s`;
    $("banner").hidden = true;
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    status.className = "status bad";
    status.textContent = `can't read /stats: ${e.message || e}`;
  }
  setTimeout(poll, POLL_MS);
}

buildPage();
wireKeyButton($("key-button"), () => {
  if (paused) {
    paused = false;
    poll();
  }
});
poll();
