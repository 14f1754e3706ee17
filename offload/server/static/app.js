// The offload dashboard: one vanilla ES module, no build step, talking to the server's own /v1 API.
//
// Safety rules this file keeps (the tests check them):
// - Job data (inputs, errors, outputs) is user data: the DOM is built with el() (dom.js), which sets text only
//   (textContent / text nodes), never innerHTML; links pass safeHref (http, https or an in-page #route).
// - The API key lives in sessionStorage (this tab only) and travels as an Authorization header; it is never
//   put in the DOM, a URL or a cookie. The sign-in field is cleared as soon as it is read.
// - Actions a key may not take are hidden, but the server decides: a forced request gets 403, shown as an error.
import { makeAutoscaleView } from "./autoscale.js";
import { makeCallbacks } from "./callbacks.js";
import { makeCharts } from "./charts.js";
import { makeLive } from "./live.js";
import { el, table } from "./dom.js";
import { makeSearch } from "./search.js";
import { spendTable, spendText, usd } from "./spend.js";
import { makeStory } from "./story.js";

const KEY = "offload.key";
const STATES = ["queued", "delayed", "retrying", "active", "held", "succeeded", "dead", "cancelled"];
const TERMINAL = new Set(["succeeded", "dead", "cancelled"]);
const PAGE = 25;
const $ = (id) => document.getElementById(id);
const enc = encodeURIComponent;

let me = null; // the signed-in key's whoami: scope and permissions
let route = { name: "overview" };
let gen = 0; // bumps on navigation, so a slow load for the previous view never draws
let seq = 0; // orders overlapping refreshes: an older answer never replaces a newer one
let drawn = 0;
let lastSig = "";
let refreshTimer = null;
// A button pressed: a redraw would replace it between its mousedown and mouseup, and the click never fires (a
// live update landing mid-click). The redraw waits for the release, after the click's handler has run.
let pressed = false;
let redrawOnRelease = false;
const cursors = {}; // "queue|state" -> stack of page cursors (null = first page)

class ApiError extends Error {
  constructor(status, body) {
    const detail = body && body.detail;
    const text = Array.isArray(detail) ? detail.map((d) => `${d.path || ""}: ${d.msg}`).join("; ") : detail;
    super(`${status || ""} ${(body && body.error) || "error"}: ${text || "request failed"}`.trim());
    this.status = status;
    this.body = body;
  }
}

// ---- formatting --------------------------------------------------------------------------------------------
const fmtTime = (ms) => (ms ? new Date(ms).toISOString().slice(0, 19).replace("T", " ") + "Z" : "—");
const fmtRate = (r) => (r === null || r === undefined ? "—" : `${r.toFixed(2)}/s`);
const pretty = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));
function ago(ms) {
  if (!ms) return "—";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  return s < 120 ? `${s}s ago` : s < 7200 ? `${Math.round(s / 60)}m ago` : `${Math.round(s / 3600)}h ago`;
}
const jobLink = (id) => el("a", { href: `#/jobs/${enc(id)}`, class: "mono", data: { job: id } }, id);
const queueLink = (q) => el("a", { href: `#/queues/${enc(q)}` }, q);

// ---- API ---------------------------------------------------------------------------------------------------
async function api(path, { method = "GET", body, key } = {}) {
  const token = key ?? sessionStorage.getItem(KEY);
  const headers = { Authorization: `Bearer ${token}`, Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let r;
  try {
    r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store", credentials: "omit" });
  } catch (_) {
    throw new ApiError(0, { error: "network", detail: "cannot reach the server" });
  }
  const doc = r.status === 204 ? null : await r.json().catch(() => null);
  if (r.status === 401 && key === undefined && me) signOut("The server no longer accepts this key (revoked?): sign in again.");
  if (!r.ok) throw new ApiError(r.status, doc);
  return doc;
}

// ---- banners, confirm, actions -----------------------------------------------------------------------------
function showError(e) {
  $("error-text").textContent = e instanceof Error ? e.message : String(e);
  $("error").hidden = false;
}
function showNotice(text) {
  const n = $("notice");
  n.textContent = text;
  n.hidden = false;
  clearTimeout(showNotice.t);
  showNotice.t = setTimeout(() => { n.hidden = true; }, 4000);
}

function ask(question, verb) {
  const d = $("confirm");
  $("confirm-text").textContent = question;
  $("confirm-ok").textContent = verb || "Confirm";
  return new Promise((resolve) => {
    const done = (v) => {
      d.oncancel = $("confirm-ok").onclick = $("confirm-cancel").onclick = null;
      if (d.open) d.close();
      resolve(v);
    };
    $("confirm-ok").onclick = () => done(true);
    $("confirm-cancel").onclick = () => done(false);
    d.oncancel = () => done(false);
    d.showModal();
  });
}

// A button for an action. perm: "admin" or "cancel"; a key without it gets the button hidden and disabled.
function action(label, perm, run, { question, danger, name } = {}) {
  const allowed = perm === "admin" ? me.can_admin : me.can_cancel;
  return el("button", {
    type: "button", class: danger ? "danger" : null, hidden: !allowed, disabled: !allowed,
    data: { action: name || label.toLowerCase() },
    onclick: async (ev) => {
      const btn = ev.currentTarget;
      if (question && !(await ask(question, label))) return;
      btn.disabled = true;
      try {
        showNotice(await run());
        $("error").hidden = true;
      } catch (e) {
        showError(e);
      } finally {
        btn.disabled = false;
        lastSig = "";
        refresh();
      }
    },
  }, label);
}

const post = (path, body) => api(path, { method: "POST", body });
// "requested": a remote job may still run; a dispatch worker cancels it, then the job ends cancelled.
const cancelJob = (id) => action("Cancel", "cancel", async () => {
  const { result } = await post(`/v1/jobs/${enc(id)}/cancel`);
  return result === "requested"
    ? `Cancel ${id}: requested (a worker cancels its remote job first, then it ends cancelled)`
    : `Cancel ${id}: ${result}`;
});
const requeueJob = (q, id) => action("Requeue", "admin", async () =>
  `Requeued ${(await post(`/v1/queues/${enc(q)}/dead/requeue`, { ids: [id] })).moved.length} job`);
const releaseJob = (q, id) => action("Release", "admin", async () =>
  `Released ${(await post(`/v1/queues/${enc(q)}/held/release`, { ids: [id] })).moved.length} job`);
const requeueAll = (q) => action("Requeue all", "admin", async () =>
  `Requeued ${(await post(`/v1/queues/${enc(q)}/dead/requeue`, { all: true })).moved.length} jobs of ${q}`,
{ name: "requeue-all" });
const releaseAll = (q) => action("Release all", "admin", async () =>
  `Released ${(await post(`/v1/queues/${enc(q)}/held/release`, { all: true })).moved.length} jobs of ${q}`,
{ name: "release-all" });
function purge(q, state, n) {
  const path = state === "dead" ? `/v1/queues/${enc(q)}/dead/purge` : `/v1/queues/${enc(q)}/purge`;
  return action(`Purge ${state}`, "admin", async () =>
    `Purged ${(await post(path, state === "dead" ? undefined : { state })).count} ${state} jobs of ${q}`,
  { danger: true, name: "purge", question: `Delete all ${n} ${state} jobs of queue ${q}? This cannot be undone.` });
}
function rowActions(job) {
  return el("td", { class: "actions" }, TERMINAL.has(job.state) ? null : cancelJob(job.id),
    job.state === "dead" ? requeueJob(job.queue, job.id) : null,
    job.state === "held" ? releaseJob(job.queue, job.id) : null);
}
function jobRows(jobs) {
  return jobs.map((j) => el("tr", { data: { job: j.id, state: j.state } }, el("td", null, jobLink(j.id)),
    el("td", null, el("span", { class: `state ${j.state}` }, j.state)), el("td", null, `${j.attempts}/${j.max_attempts}`),
    el("td", null, fmtTime(j.finished_at || j.created_at)), el("td", { class: "err" }, shownError(j)), rowActions(j)));
}
// A job that succeeded after a failed attempt keeps that attempt's error: say whose it is.
const shownError = (j) => !j.error ? "" : j.state === "succeeded" ? `earlier attempt: ${j.error}` : j.error;
const JOB_HEADS = ["Job", "State", "Attempts", "Updated", "Error", ""];
// Search on the queue page, error groups in the dead letter (search.js).
const charts = makeCharts({ api }); // history charts (charts.js), on the overview, queue and Autoscaling pages
const search = makeSearch({ el, api, table, enc, jobRows, jobHeads: JOB_HEADS, jobLink, ask, showNotice, showError,
  me: () => me, redraw: () => { lastSig = ""; refresh(); } });

// Failed completion webhooks on the dead letter page (callbacks.js).
const callbacks = makeCallbacks({ el, api, table, enc, jobLink, queueLink, fmtTime, ask, showNotice, showError,
  me: () => me, redraw: () => { lastSig = ""; refresh(); } });

// ---- views -------------------------------------------------------------------------------------------------
function budgetText(b) {
  if (!b) return "—";
  let text = b.jobs_cap === null ? `${b.jobs_used} jobs` : `${b.jobs_used} / ${b.jobs_cap} jobs`;
  if (b.spend_cap !== null || b.spend_used > 0) {
    text += ` · $${b.spend_used.toFixed(2)}${b.spend_cap === null ? "" : ` / $${b.spend_cap.toFixed(2)}`}`;
  }
  return text;
}
const inFlight = (c) => (c.active || 0) + (c.submitted || 0);
// A queue's status (server: offload/caps.py): paused, capped (a daily cap reached: which one, and with the queue's
// budget `b` the cap and today's use, so a capped queue never passes for a running one), else running.
const capUse = (kind, b) => (kind === "jobs" ? `${b.jobs_used} of ${b.jobs_cap} jobs today`
  : `$${b.spend_used.toFixed(2)} of $${(b.spend_cap ?? 0).toFixed(2)} spent today`);
function statusBadge(q, id, b) {
  if (q.status === "running") return null;
  const capped = q.status === "capped";
  const badge = el("span", { class: `badge ${q.status}`, id, title: capped
    ? `daily ${q.capped} cap reached: queued jobs wait for the next window (UTC day)` : null },
  capped ? `capped: ${q.capped}` : q.status);
  return capped && b ? [badge, " ", el("span", { class: "muted", data: { capUse: q.capped } }, capUse(q.capped, b))] : badge;
}
const card = (label, value, name) => el("div", { class: "card", data: { card: name } },
  el("div", { class: "value" }, value), el("div", { class: "label" }, label));

const overview = {
  async load() {
    const [queues, budget, workers] = await Promise.all([api("/v1/queues"), api("/v1/dashboard/budget"),
      me.can_see_workers ? api("/v1/workers") : null]);
    return { queues, budget, workers };
  },
  draw({ queues, budget, workers }) {
    const budgets = Object.fromEntries(budget.map((b) => [b.queue, b]));
    const sum = (f) => queues.reduce((n, q) => n + f(q), 0);
    const rows = queues.map((q) => {
      const c = q.counts;
      const cell = (col, v) => el("td", { data: { col }, class: "num" }, v);
      return el("tr", { data: { queue: q.queue } }, el("td", null, queueLink(q.queue)),
        el("td", { data: { col: "status" } }, statusBadge(q, null, budgets[q.queue]) || "running"),
        cell("queued", c.queued), cell("inflight", inFlight(c)), cell("waiting", c.delayed + c.retrying),
        cell("held", c.held), cell("dead", c.dead), cell("succeeded", c.succeeded),
        cell("enqueue-rate", fmtRate(q.rates.enqueued)), cell("done-rate", fmtRate(q.rates.succeeded)),
        cell("workers", q.workers), el("td", { data: { col: "budget" } }, budgetText(budgets[q.queue])),
        el("td", { data: { col: "spend" } }, spendText(q)));
    });
    return el("section", null, el("h1", null, "Overview"),
      el("div", { class: "cards" }, card("queues", queues.length, "queues"),
        card("in flight", sum((q) => inFlight(q.counts)), "inflight"), card("queued", sum((q) => q.counts.queued), "queued"),
        card("workers", workers ? workers.length : "—", "workers"), card("dead", sum((q) => q.counts.dead), "dead")),
      charts.panel("overview"),
      queues.length ? table(["Queue", "Status", "Queued", "In flight", "Delayed / retrying", "Held", "Dead", "Succeeded",
        "Enqueue rate", "Success rate", "Workers", "Budget today (UTC)", "Spend today (UTC)"], rows, { id: "queues" })
        : el("p", { class: "muted" }, "No queues yet: enqueue a job to create one."),
      workers && workers.length ? [el("h2", null, "Workers ", el("a", { href: "#/workers", class: "more" }, "all →")),
        table(["Worker", "Host", "Queues", "In flight", "Last heartbeat"], workers.slice(0, 10).map((w) =>
          el("tr", { data: { worker: w.id } }, el("td", { class: "mono" }, w.id), el("td", null, w.host || "—"),
            el("td", null, w.queues.join(", ")), el("td", { class: "num", data: { col: "inflight" } }, w.in_flight),
            el("td", null, ago(w.last_heartbeat)))), { id: "overview-workers" })] : null);
  },
};

const queueView = {
  busy: () => search.busy(),
  async load({ queue, state }) {
    const stack = (cursors[`${queue}|${state}`] ||= [null]);
    const cursor = stack[stack.length - 1];
    const [q, page] = await Promise.all([api(`/v1/queues/${enc(queue)}`),
      api(`/v1/queues/${enc(queue)}/jobs?state=${enc(state)}&limit=${PAGE}${cursor ? `&cursor=${cursor}` : ""}`)]);
    // the budget (every queue's usage) only for a capped queue: its label shows the cap and today's use
    const budget = q.status === "capped" ? (await api("/v1/dashboard/budget")).find((b) => b.queue === queue) : null;
    return { q, page, pageNo: stack.length, budget };
  },
  draw({ q, page, pageNo, budget }, { queue, state }) {
    const stack = cursors[`${queue}|${state}`];
    const count = (s) => (s === "active" ? inFlight(q.counts) : q.counts[s] || 0);
    const turn = (fn) => () => { fn(); lastSig = ""; refresh(); };
    const tabs = STATES.map((s) => el("a", { href: `#/queues/${enc(queue)}?state=${s}`, class: s === state ? "tab on" : "tab",
      data: { state: s } }, s, " ", el("span", { class: "n" }, count(s))));
    return el("section", null,
      el("h1", null, "Queue ", el("span", { class: "mono" }, queue), " ", statusBadge(q, q.status, budget)),
      el("div", { class: "toolbar" },
        q.paused ? action("Resume", "admin", async () => { await post(`/v1/queues/${enc(queue)}/resume`); return `Resumed ${queue}`; })
          : action("Pause", "admin", async () => { await post(`/v1/queues/${enc(queue)}/pause`); return `Paused ${queue}`; }),
        state === "dead" ? requeueAll(queue) : null, state === "held" ? releaseAll(queue) : null,
        state !== "active" && count(state) > 0 ? purge(queue, state, count(state)) : null,
        el("span", { class: "muted" }, `${q.workers} workers · enqueued ${fmtRate(q.rates.enqueued)} · succeeded ${fmtRate(q.rates.succeeded)}`)),
      charts.panel("queue", queue), el("h2", null, "Spend"), spendTable(q, el),
      el("h2", null, "Search"), search.searchPanel(queue),
      el("nav", { class: "tabs" }, tabs),
      page.jobs.length ? table(JOB_HEADS, jobRows(page.jobs), { id: "jobs" }) : el("p", { class: "muted" }, `No ${state} jobs.`),
      el("div", { class: "pager" },
        el("button", { type: "button", disabled: pageNo <= 1, data: { page: "prev" }, onclick: turn(() => stack.pop()) }, "← Previous"),
        el("span", null, `page ${pageNo}`),
        el("button", { type: "button", disabled: !page.next_cursor, data: { page: "next" },
          onclick: turn(() => stack.push(page.next_cursor)) }, "Next →")));
  },
};

// A fleet job without a cost ran on a GPU worker that is no rented machine: its price is unknown, not $0.
const jobCost = (j) => (j.cost != null ? usd(j.cost)
  : j.kind === "fleet" && j.state === "succeeded" ? "unknown: its GPU worker is no rented machine (no price)" : null);

// The attempts, files and events under the record (story.js).
const story = makeStory({ el, table, enc, fmtTime });
const jobView = {
  load: ({ id }) => Promise.all([api(`/v1/jobs/${enc(id)}`), story.load(api, id)]),
  draw([j, told]) {
    const row = (label, value, name) => [el("dt", null, label), el("dd", { data: { field: name } }, value ?? "—")];
    const output = j.result_url
      ? el("a", { href: j.result_url, target: "_blank", rel: "noopener noreferrer", id: "output-link" }, "Open output")
      : null;
    return el("section", null,
      el("h1", null, "Job ", el("span", { class: "mono" }, j.id)),
      el("div", { class: "toolbar" }, TERMINAL.has(j.state) ? null : cancelJob(j.id),
        j.state === "dead" ? requeueJob(j.queue, j.id) : null, j.state === "held" ? releaseJob(j.queue, j.id) : null),
      el("dl", { class: "fields" },
        row("Queue", queueLink(j.queue), "queue"), row("State", el("span", { class: `state ${j.state}` }, j.state), "state"),
        row("Attempts", `${j.attempts} of ${j.max_attempts}` + (j.lease_expiries ? ` (${j.lease_expiries} lease expiries)` : ""), "attempts"),
        row("Priority", j.priority, "priority"), row("Created", fmtTime(j.created_at), "created"),
        row("Started", fmtTime(j.started_at), "started"), row("Finished", fmtTime(j.finished_at), "finished"),
        row("Worker", j.lease_owner, "worker"), row("Backend", j.backend && `${j.backend} ${j.remote_id || ""}`, "backend"),
        row("Kind", j.kind, "kind"), row("Cost", jobCost(j), "cost"), row("Output key", j.output_key, "output-key"),
        j.deadline != null ? row("Deadline", fmtTime(j.deadline), "deadline") : null,
        j.max_cost != null ? row("Max cost", j.max_cost, "max-cost") : null,
        row("Result", j.result ? [el("span", { class: "mono" }, j.result), " ", output] : null, "result"),
        j.cancel_requested ? row("Cancel", "requested: a worker cancels its remote job, then it ends cancelled", "cancel") : null),
      j.error ? [el("h2", null, j.state === "succeeded" ? "Error of an earlier attempt" : "Error"),
        el("pre", { id: "job-error", class: "err" }, j.error)] : null,
      story.draw(j, told), el("h2", null, "Input"), el("pre", { id: "job-input" }, pretty(j.input)),
      j.raw ? [el("h2", null, "Raw entry"), el("pre", { id: "job-raw" }, j.raw)] : null);
  },
};

function setView(state) {
  const verb = state === "dead" ? "Requeue" : "Release";
  return {
    async load() {
      // Held also lists a capped queue's queued jobs: over a cap the queue takes no fresh job, so they are what
      // the cap holds back (only jobs claimed before the cap was reached move to the held set itself).
      const capped = (q) => state === "held" && q.status === "capped" && q.counts.queued > 0;
      const all = await api("/v1/queues");
      const queues = all.filter((q) => q.counts[state] > 0 || capped(q));
      const list = (q, path) => api(`/v1/queues/${enc(q.queue)}/${path}limit=${PAGE}`);
      const [pages, hooks] = await Promise.all([Promise.all(queues.map((q) => Promise.all([list(q, `${state}?`),
        capped(q) ? list(q, "jobs?state=queued&") : null, state === "dead" ? api(`/v1/queues/${enc(q.queue)}/dead/groups`) : null]))),
      state === "dead" ? callbacks.load(all.map((q) => q.queue)) : []]);
      return { hooks, sets: queues.map((q, i) => ({ queue: q.queue, count: q.counts[state], jobs: pages[i][0].jobs, groups: pages[i][2],
        more: !!pages[i][0].next_cursor, capped: capped(q) ? { kind: q.capped, count: q.counts.queued, jobs: pages[i][1].jobs } : null })) };
    },
    draw({ sets, hooks }) {
      const title = state === "dead" ? "Dead letter" : "Held jobs";
      const why = state === "dead" ? "Jobs that used up their attempts or were rejected as bad input. " +
        `${verb} gives them a fresh attempt budget.` : "Jobs held over a daily cap; they are released when the window resets. " +
        `${verb} sends them to the queue now.`;
      return el("section", null, el("h1", null, title), el("p", { class: "muted" }, why),
        sets.length ? sets.map((s) => el("section", { class: "set", data: { queue: s.queue } },
          el("h2", null, queueLink(s.queue), ` · ${s.count} ${state}`, s.capped ? [" ", statusBadge({ status: "capped", capped: s.capped.kind })] : null),
          s.count ? [el("div", { class: "toolbar" }, state === "dead" ? requeueAll(s.queue) : releaseAll(s.queue), purge(s.queue, state, s.count)),
            s.groups && s.groups.groups.length ? search.deadGroups(s.queue, s.groups) : null, table(JOB_HEADS, jobRows(s.jobs))] : null,
          s.more ? el("a", { href: `#/queues/${enc(s.queue)}?state=${state}` }, `All ${s.count} in the queue view →`) : null,
          s.capped ? [el("p", { class: "muted", data: { capped: s.capped.kind } }, `Capped: the daily ${s.capped.kind} cap is reached, so ` +
            `${s.capped.count} queued job${s.capped.count === 1 ? "" : "s"} wait for the next cap window (the job store's UTC day).`),
          table(JOB_HEADS, jobRows(s.capped.jobs), { id: `capped-${s.queue}` })] : null))
          : el("p", { class: "empty" }, `No ${state} jobs.`), callbacks.section(hooks));
    },
  };
}

const workersView = {
  load: () => (me.can_see_workers ? api("/v1/workers") : null),
  draw(workers) {
    if (workers === null) {
      return el("p", { class: "muted" }, "Workers span every queue: they need an admin key or an unrestricted viewer key.");
    }
    const rows = workers.map((w) => el("tr", { data: { worker: w.id } },
      el("td", { class: "mono" }, w.id), el("td", null, w.kind), el("td", { data: { col: "host" } }, w.host || "—"),
      el("td", { data: { col: "version" } }, w.version || "—"), el("td", null, w.queues.map((q) => [queueLink(q), " "])),
      el("td", { class: "num", data: { col: "inflight" } }, w.in_flight),
      el("td", { data: { col: "heartbeat" }, title: fmtTime(w.last_heartbeat) }, ago(w.last_heartbeat)),
      el("td", { data: { col: "instance" } }, w.instance_id || "—"), el("td", { data: { col: "protected" } }, w.protected ? "yes" : "no"),
      el("td", null, w.gpus.map((g) => g.name || "gpu").join(", ") || "—")));
    return el("section", null, el("h1", null, "Workers"),
      workers.length ? table(["Worker", "Kind", "Host", "Version", "Queues", "In flight", "Last heartbeat", "Instance",
        "Protected", "GPUs"], rows, { id: "workers" }) : el("p", { class: "empty" }, "No live workers."));
  },
};

// Autoscaling (autoscale.js): instances, per-queue config, spend and why, providers, and their forms.
const autoscaleView = makeAutoscaleView({
  el, api, table, queueLink, enc, action, showNotice, charts, me: () => me, redraw: () => { lastSig = ""; refresh(); },
});

const VIEWS = { overview, queue: queueView, job: jobView, dead: setView("dead"), held: setView("held"), workers: workersView,
  autoscale: autoscaleView };

// ---- routing and refresh -----------------------------------------------------------------------------------
function parseRoute() {
  const [path, query] = location.hash.slice(1).split("?");
  const parts = (path || "/").split("/").filter(Boolean).map((p) => { try { return decodeURIComponent(p); } catch (_) { return p; } });
  const state = new URLSearchParams(query || "").get("state");
  if (parts[0] === "queues" && parts[1]) return { name: "queue", queue: parts[1], state: STATES.includes(state) ? state : "queued" };
  if (parts[0] === "jobs" && parts[1]) return { name: "job", id: parts[1] };
  if (["dead", "held", "workers", "autoscale"].includes(parts[0])) return { name: parts[0] };
  return { name: "overview" };
}

function navigate() {
  if (!me) return;
  route = parseRoute();
  autoscaleView.reset();
  gen += 1;
  lastSig = "";
  document.body.dataset.view = route.name;
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("on", a.dataset.nav === route.name);
  $("view").replaceChildren(el("p", { class: "muted" }, "Loading…"));
  refresh();
}

// Presigned URLs change on every read; they do not count as a change worth redrawing for.
const signature = (data) => JSON.stringify(data, (k, v) => (k === "result_url" ? undefined : v));

async function refresh() {
  if (!me) return;
  const mine = gen;
  const n = ++seq;
  const view = VIEWS[route.name];
  if (view.busy && view.busy()) return; // a form is open: redraw when it closes
  try {
    const data = await view.load(route);
    if (mine !== gen || n < drawn || !me) return;
    if (pressed) {
      redrawOnRelease = true;
      document.body.dataset.redraw = "after-release";
      return;
    }
    drawn = n;
    const sig = signature(data);
    if (sig === lastSig) return;
    lastSig = sig;
    $("view").replaceChildren(view.draw(data, route));
  } catch (e) {
    if (mine === gen && me) $("view").replaceChildren(el("p", { class: "error load-error" }, e.message));
  }
}

function schedule() {
  if (refreshTimer === null) refreshTimer = setTimeout(() => { refreshTimer = null; refresh(); }, 200);
}

// The event stream and the slow refresh (live.js): any job event schedules a refresh of the current view.
const live = makeLive({ token: () => sessionStorage.getItem(KEY), active: () => me !== null, changed: schedule, refresh });

// ---- sign-in -----------------------------------------------------------------------------------------------
function showSignin(message) {
  $("top").hidden = true;
  $("view").replaceChildren();
  $("signin").hidden = false;
  const err = $("signin-error");
  err.textContent = message || "";
  err.hidden = !message;
  $("key").focus();
}

function start(who) {
  me = who;
  $("signin").hidden = true;
  $("top").hidden = false;
  $("who").textContent = who.can_admin ? `${who.scope}` : `${who.scope} · ${who.can_cancel ? "may cancel" : "read-only"}`;
  $("who").title = who.name ? `key: ${who.name}` : "";
  live.start();
  navigate();
}

function signOut(message) {
  me = null;
  sessionStorage.removeItem(KEY);
  live.stop();
  $("error").hidden = true;
  showSignin(message);
}

async function signIn(ev) {
  ev.preventDefault();
  const input = $("key");
  const key = input.value.trim();
  input.value = ""; // the key never stays in the page
  if (!/^[\x21-\x7e]{1,256}$/.test(key)) {
    showSignin("That is not an API key: keys are printable ASCII, like ofk_….");
    return;
  }
  try {
    const who = await api("/v1/dashboard/whoami", { key });
    if (who.scope === "worker") {
      showSignin("Sign-in failed: a worker key cannot use the dashboard. Use a viewer or admin key.");
      return;
    }
    sessionStorage.setItem(KEY, key);
    start(who);
  } catch (e) {
    showSignin(e.status === 401 ? "Sign-in failed: the server did not accept that key (invalid or revoked)."
      : `Sign-in failed: ${e.message}`);
  }
}

async function boot() {
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", () => signOut());
  $("error-close").addEventListener("click", () => { $("error").hidden = true; });
  window.addEventListener("hashchange", navigate);
  document.addEventListener("pointerdown", () => { pressed = true; }, true);
  const release = () => {
    pressed = false;
    if (!redrawOnRelease) return;
    redrawOnRelease = false;
    delete document.body.dataset.redraw;
    setTimeout(() => { lastSig = ""; refresh(); }, 0); // after the click this release ends
  };
  document.addEventListener("pointerup", release, true);
  document.addEventListener("pointercancel", release, true);
  window.addEventListener("blur", release); // released outside the window: no pointerup reaches us
  if (!sessionStorage.getItem(KEY)) {
    showSignin();
    return;
  }
  try {
    start(await api("/v1/dashboard/whoami"));
  } catch (e) {
    if (e.status === 401) sessionStorage.removeItem(KEY);
    if (!me) showSignin(e.status === 401 ? "The saved key is no longer accepted: sign in again." : e.message);
  }
}

boot();
