// History charts (server: GET /v1/history, all readable queues summed, and GET /v1/queues/{queue}/history): the
// overview's throughput and spend; a queue's throughput, wait and run percentiles, backlog and in flight, spend by
// kind and by backend; the Autoscaling page's fleet size and cost. Each over the last hour, day or week.
//
// - uPlot draws (static/vendor/, shipped in the package: the CSP allows scripts from this origin only). It styles
//   through the CSSOM and writes labels with textContent, so the CSP needs no 'unsafe-inline' or 'unsafe-eval'.
// - Readable without colour: every line has its own dash pattern and the legend names it (and shows its value under
//   the cursor); every chart has a "Table" (<details>) with the same points as a real <table>.
// - A panel survives the page's redraws (the page puts the same node back), so the open table, the range and the
//   plots stay put. It reloads when the page redraws (at most every 3 s) and every 15 s, and drops its plots once
//   it is out of the page. Queue and backend names are data: text only (el(), uPlot's textContent labels).
import { el } from "./dom.js";
import { usd } from "./spend.js";

const RANGES = [["hour", "Last hour"], ["day", "Last day"], ["week", "Last week"]];
// [stroke, the line's dash, the legend marker's border style]: Okabe-Ito colours, told apart without them too
const STYLES = [["#0072b2", [], "solid"], ["#009e73", [8, 4], "dashed"], ["#d55e00", [2, 3], "dotted"],
  ["#cc79a7", [12, 3, 3, 3], "double"], ["#e69f00", [16, 6], "dashed"], ["#56b4e9", [4, 2, 1, 2], "dotted"],
  ["#000000", [1, 5], "dotted"]];
const HEIGHT = 180;
const REDRAW_MS = 3000;
const POLL_MS = 15000;
const COUNT_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 1e7];

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const at = (obj, key) => num(obj ? obj[key] : null);
const fmtCount = (v) => (v === null ? "—" : String(Math.round(v)));
const fmtMs = (v) => (v === null ? "—" : String(Number(v.toFixed(1))));
const fmtUsd = (v) => (v === null ? "—" : usd(v));
const stamp = (t) => new Date(t * 1000).toISOString().slice(0, 16).replace("T", " ");
// the time axis in UTC and 24 h: a day's date at midnight (or when ticks are days apart), else its hour and minute
const timeTick = (t, incr) => (incr >= 86400 || t % 86400 === 0 ? stamp(t).slice(5, 10) : stamp(t).slice(11));
const TICK = { count: (v) => String(v), ms: (v) => String(v), usd: (v) => `$${Number(v.toPrecision(3))}` };
function per(step) {
  if (step === 60) return "minute";
  if (step === 3600) return "hour";
  return step % 3600 === 0 ? `${step / 3600} hours` : `${Math.round(step / 60)} minutes`;
}

// name -> title, unit (from the step), kind of numbers, and its lines: [label, value of a point] (or a function of
// the points, for lines named by the data)
const pct = (field) => ["p50", "p95", "p99"].map((p) => [p, (pt) => at(pt[field], p)]);
const CHARTS = {
  throughput: { title: "Throughput and failures", unit: (s) => `jobs per ${per(s)}`, kind: "count", lines: [
    ["Enqueued", (p) => at(p, "enqueued")], ["Succeeded", (p) => at(p, "succeeded")],
    ["Failed (retried)", (p) => at(p, "failed")],
    ["Dead", (p) => at(p, "dead")], ["Cancelled", (p) => at(p, "cancelled")]] },
  wait: { title: "Wait time", unit: (s) => `ms from ready to claimed, per ${per(s)}`, kind: "ms", lines: pct("wait_ms") },
  run: { title: "Run time", unit: (s) => `ms from claimed to succeeded, per ${per(s)}`, kind: "ms", lines: pct("run_ms") },
  load: { title: "Backlog and in flight", unit: (s) => `jobs, the peak of each ${per(s)}`, kind: "count", lines: [
    ["Backlog", (p) => at(p, "backlog")], ["In flight", (p) => at(p, "in_flight")]] },
  spend: { title: "Spend by kind", unit: (s) => `USD per ${per(s)}`, kind: "usd", lines: [
    ["Serverless", (p) => at(p.spend_usd, "serverless")], ["Fleet", (p) => at(p.spend_usd, "fleet")]] },
  backends: { title: "Spend by backend", unit: (s) => `USD per ${per(s)}`, kind: "usd", lines: (points) =>
    [...new Set(points.flatMap((p) => Object.keys(p.spend_by_backend || {})))].sort()
      .map((name) => [name, (p) => at(p.spend_by_backend, name) ?? 0]) },
  fleet: { title: "Fleet size", unit: (s) => `machines running or starting, the peak of each ${per(s)}`, kind: "count",
    stepped: true, lines: [["Machines", (p) => at(p, "fleet_machines")]] },
  fleetCost: { title: "Fleet cost", unit: () => "their price, USD per hour", kind: "usd", stepped: true, lines: [
    ["USD per hour", (p) => at(p, "fleet_usd_per_h")]] },
};
const FORMAT = { count: fmtCount, ms: fmtMs, usd: fmtUsd };
const PAGES = {
  overview: { path: () => "/v1/history", charts: ["throughput", "spend"] },
  queue: { path: (q) => `/v1/queues/${encodeURIComponent(q)}/history`,
    charts: ["throughput", "wait", "run", "load", "spend", "backends"] },
  fleet: { path: () => "/v1/history", charts: ["fleet", "fleetCost"] },
};

// The points to mark when uPlot draws lines only (dense data): a value with no value on either side has no line.
function lonePoints(u, i, show) {
  if (show) return null;
  const ys = u.data[i];
  const lone = ys.flatMap((y, j) => (y !== null && ys[j - 1] == null && ys[j + 1] == null ? [j] : []));
  return lone.length ? lone : null;
}

function plotOptions(spec, lines, width) {
  const fmt = FORMAT[spec.kind];
  return {
    width, height: HEIGHT,
    tzDate: (ts) => window.uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"), // UTC, as the rest of the dashboard
    scales: { y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
    series: [{ label: "UTC", value: (u, t) => (t === null ? "—" : stamp(t)) },
      ...lines.map(([label], i) => {
        const [stroke, dash] = STYLES[i % STYLES.length];
        return { label, stroke, dash, width: 2, value: (u, v) => fmt(num(v)), points: { size: 6, filter: lonePoints },
          paths: spec.stepped ? window.uPlot.paths.stepped({ align: 1 }) : undefined }; // a gauge holds till it moves
      })],
    axes: [{ space: 60, values: (u, ticks, axis, space, incr) => ticks.map((t) => timeTick(t, incr)) },
      { size: 64, values: (u, ticks) => ticks.map(TICK[spec.kind]),
        incrs: spec.kind === "count" ? COUNT_STEPS : undefined }], // whole jobs only
    legend: { markers: { dash: (u, i) => STYLES[(i - 1) % STYLES.length][2] } },
    focus: { alpha: 0.3 }, // the line under the cursor (or a hovered legend entry) stands out: no colour needed
    cursor: { focus: { prox: 16 } },
  };
}

// One chart: its caption, the plot, and the same points in a table.
function makeFigure(name) {
  const spec = CHARTS[name];
  const unit = el("span", { class: "muted" });
  const plot = el("div", { class: "plot", "aria-hidden": "true" }); // the table is what a screen reader reads
  const note = el("p", { class: "muted", hidden: true });
  const head = el("thead");
  const body = el("tbody");
  const node = el("figure", { class: "chart", data: { chart: name } }, el("figcaption", null, spec.title, " ", unit),
    plot, note, el("details", null, el("summary", null, "Table"),
      el("div", { class: "scroll" }, el("table", { "aria-label": spec.title }, head, body))));
  let u = null;
  let drawnLines = "";

  function show(doc) {
    const points = doc.points || [];
    const lines = typeof spec.lines === "function" ? spec.lines(points) : spec.lines;
    const fmt = FORMAT[spec.kind];
    const xs = points.map((p) => p.t);
    const ys = lines.map(([, get]) => points.map(get));
    unit.textContent = `(${spec.unit(doc.step_s)})`;
    const col = (text) => el("th", { scope: "col" }, text);
    head.replaceChildren(el("tr", null, col("Time (UTC)"), lines.map(([label]) => col(label))));
    body.replaceChildren(...points.map((p, i) => el("tr", null, el("th", { scope: "row" }, stamp(p.t)),
      ys.map((y) => el("td", { class: "num" }, fmt(y[i]))))));
    note.hidden = lines.length > 0;
    note.textContent = lines.length ? "" : "Nothing in this range.";
    const sig = JSON.stringify(lines.map(([l]) => l));
    if (u && sig === drawnLines) {
      u.setData([xs, ...ys]);
      return;
    }
    destroy();
    drawnLines = sig;
    if (lines.length) u = new window.uPlot(plotOptions(spec, lines, plot.clientWidth || 600), [xs, ...ys], plot);
  }
  function fit() {
    if (u && plot.clientWidth && plot.clientWidth !== u.width) u.setSize({ width: plot.clientWidth, height: HEIGHT });
  }
  function destroy() {
    if (u) u.destroy();
    u = null;
  }
  return { node, show, fit, destroy };
}

export function makeCharts({ api }) {
  const panels = new Map(); // "kind|queue" -> a panel in the page
  const ranges = {}; // kind -> the range last chosen there

  function makePanel(key, kind, queue) {
    const page = PAGES[kind];
    let range = ranges[kind] || "hour";
    let seq = 0;
    let shown = 0;
    let last = 0;
    const figures = page.charts.map(makeFigure);
    const status = el("p", { class: "muted chart-status", role: "status" }, "Loading history…");
    const buttons = RANGES.map(([r, label]) => el("button", { type: "button", "aria-pressed": String(r === range),
      data: { range: r }, onclick: () => choose(r) }, label));
    const grid = el("div", { class: "charts" }, figures.map((f) => f.node));
    const node = el("section", { class: "history", "aria-label": "History" },
      el("div", { class: "history-head" }, el("h2", null, "History"),
        el("div", { class: "ranges", role: "group", "aria-label": "History range" }, buttons)), status, grid);
    const resize = new ResizeObserver(() => figures.forEach((f) => f.fit()));
    resize.observe(grid);
    const timer = setInterval(() => (node.isConnected ? load() : stop()), POLL_MS);

    async function load() {
      const mine = ++seq;
      const want = range;
      last = Date.now();
      try {
        const doc = await api(`${page.path(queue)}?range=${want}`);
        if (!node.isConnected) return stop();
        if (mine < shown || want !== range) return; // an older answer, or for the range shown before
        shown = mine;
        const n = (doc.points || []).length;
        status.textContent = `${RANGES.find(([r]) => r === want)[1]}: ${n} points, one per ${per(doc.step_s)} (UTC).`;
        figures.forEach((f) => f.show(doc));
      } catch (e) {
        if (mine === seq) status.textContent = `History unavailable: ${e.message}`;
      }
    }
    function choose(r) {
      range = ranges[kind] = r;
      buttons.forEach((b) => b.setAttribute("aria-pressed", String(b.dataset.range === r)));
      load();
    }
    function stop() {
      clearInterval(timer);
      resize.disconnect();
      figures.forEach((f) => f.destroy());
      if (panels.get(key) === panel) panels.delete(key);
    }
    const panel = { node, stop, poke: () => { if (Date.now() - last > REDRAW_MS) load(); } };
    return panel;
  }

  // The history panel of a page (kind: overview, queue or fleet), the same node on each redraw of that page (a
  // panel out of the page stops itself at its next load, so one kept is at most 15 s out of the page).
  function panel(kind, queue) {
    const key = `${kind}|${queue ?? ""}`;
    if (!panels.has(key)) panels.set(key, makePanel(key, kind, queue));
    const p = panels.get(key);
    p.poke();
    return p.node;
  }
  return { panel };
}
