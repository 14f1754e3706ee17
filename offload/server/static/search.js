// The queue page's job search and the dead letter's error groups (server: routes_search.py).
//
// What the person typed, the last results and the groups they ticked live here, per queue, so the page's redraws
// (on every job event) keep them; while the search form has the focus the page does not redraw at all (busy()).
// Like app.js, the DOM is built with el() only: job data and errors are text, never markup.
const STATES = ["queued", "delayed", "retrying", "active", "held", "succeeded", "dead", "cancelled"];

export function makeSearch({ el, api, table, enc, jobRows, jobHeads, jobLink, ask, showNotice, showError, me, redraw }) {
  const forms = {}; // queue -> { id, state, error, backend, idem, from, to, page, problem }
  const picked = {}; // queue -> Set of the dead-letter groups ticked (their patterns)

  const busy = () => !!document.activeElement?.closest?.("form.search");

  async function run(queue, s, out, cursor) {
    const q = new URLSearchParams({ limit: "25" });
    if (s.id.trim()) q.set("id", s.id.trim());
    if (s.state) q.set("state", s.state);
    if (s.error) q.set("error", s.error);
    if (s.backend.trim()) q.set("backend", s.backend.trim());
    if (s.idem) q.set("idempotency_key", s.idem);
    // The page shows UTC times, so the range is typed in UTC too ("2026-12-06T14:00" means 14:00Z).
    for (const [name, param] of [["from", "created_from"], ["to", "created_to"]]) {
      if (s[name]) q.set(param, String(Date.parse(`${s[name]}Z`)));
    }
    if (cursor) q.set("cursor", cursor);
    try {
      s.page = await api(`/v1/queues/${enc(queue)}/search?${q}`);
      s.problem = "";
    } catch (e) {
      s.page = null;
      s.problem = e.message;
    }
    out.replaceChildren(...results(s, queue, out));
  }

  function results(s, queue, out) {
    if (s.problem) return [el("p", { class: "error", role: "alert" }, s.problem)];
    if (!s.page) return [];
    const more = s.page.next_cursor
      ? el("button", { type: "button", data: { page: "search-next" }, onclick: () => run(queue, s, out, s.page.next_cursor) },
        s.page.jobs.length ? "More results →" : "Search further →")
      : null;
    const found = s.page.jobs.length
      ? table(jobHeads, jobRows(s.page.jobs), { id: "search-results", "aria-label": "Search results" })
      : el("p", { class: "muted" }, s.page.next_cursor ? "No match in the jobs read so far." : "No job matches.");
    return [found, more];
  }

  function searchPanel(queue) {
    const s = (forms[queue] ||= { id: "", state: "", error: "", backend: "", idem: "", from: "", to: "", page: null,
      problem: "" });
    const keep = (name) => (ev) => { s[name] = ev.target.value; };
    const field = (label, name, input) => el("div", { class: "field" }, el("label", { for: `search-${name}` }, label), input);
    const text = (name, max) => el("input", { id: `search-${name}`, type: "search", value: s[name], maxlength: max,
      spellcheck: "false", oninput: keep(name) });
    const state = el("select", { id: "search-state", onchange: keep("state") },
      el("option", { value: "", selected: !s.state }, "any state"),
      STATES.map((st) => el("option", { value: st, selected: s.state === st }, st)));
    const when = (name) => el("input", { id: `search-${name}`, type: "datetime-local", value: s[name], oninput: keep(name) });
    const out = el("div", { class: "search-out", "aria-live": "polite" });
    out.replaceChildren(...results(s, queue, out));
    return el("div", null,
      el("form", { class: "search", role: "search", "aria-label": "Search jobs",
        onsubmit: (ev) => { ev.preventDefault(); run(queue, s, out, null); } },
      field("Job id or prefix", "id", text("id", 200)), field("State", "state", state),
      field("Error text", "error", text("error", 500)), field("Backend", "backend", text("backend", 100)),
      field("Idempotency key", "idem", text("idem", 1024)), field("Created from (UTC)", "from", when("from")),
      field("Created to (UTC)", "to", when("to")), el("button", { type: "submit" }, "Search")),
      out);
  }

  // "Requeue group" / "Purge group": every ticked group, after the person confirms.
  function groupAction(queue, groups, verb, path, danger) {
    const sel = (picked[queue] ||= new Set());
    const allowed = me().can_admin;
    return el("button", { type: "button", class: danger ? "danger" : null, hidden: !allowed, disabled: !allowed || !sel.size,
      data: { action: `${verb.toLowerCase()}-group` },
      onclick: async (ev) => {
        const btn = ev.currentTarget;
        const chosen = groups.filter((g) => sel.has(g.pattern));
        const n = chosen.reduce((t, g) => t + g.count, 0);
        const what = `${n} dead job${n === 1 ? "" : "s"} of queue ${queue} (${chosen.length} error group${chosen.length === 1 ? "" : "s"})`;
        const question = danger ? `Delete ${what}? This cannot be undone.` : `Requeue ${what} with a fresh attempt budget?`;
        if (!chosen.length || !(await ask(question, `${verb} group`))) return;
        btn.disabled = true;
        try {
          let done = 0;
          for (const g of chosen) {
            const r = await api(`/v1/queues/${enc(queue)}/dead/groups/${path}`, { method: "POST", body: { pattern: g.pattern } });
            done += r.moved ? r.moved.length : r.count;
          }
          sel.clear();
          showNotice(`${danger ? "Purged" : "Requeued"} ${done} job${done === 1 ? "" : "s"} of ${queue}`);
        } catch (e) {
          showError(e);
        } finally {
          redraw();
        }
      } }, `${verb} group`);
  }

  function deadGroups(queue, reply) {
    const sel = (picked[queue] ||= new Set());
    for (const p of [...sel]) if (!reply.groups.some((g) => g.pattern === p)) sel.delete(p); // gone meanwhile
    const buttons = [groupAction(queue, reply.groups, "Requeue", "requeue", false),
      groupAction(queue, reply.groups, "Purge", "purge", true)];
    const tick = (g) => el("input", { type: "checkbox", checked: sel.has(g.pattern), "aria-label": `Select group: ${g.pattern}`,
      onchange: (ev) => {
        if (ev.target.checked) sel.add(g.pattern); else sel.delete(g.pattern);
        for (const b of buttons) b.disabled = !me().can_admin || !sel.size;
      } });
    const rows = reply.groups.map((g) => el("tr", { data: { group: g.pattern } }, el("td", null, tick(g)),
      el("td", { class: "err", title: g.example }, g.pattern), el("td", { class: "num", data: { col: "count" } }, g.count),
      el("td", null, g.sample_ids.map((id) => [jobLink(id), " "]))));
    return el("div", { class: "groups", data: { queue } },
      el("h3", null, "By error"),
      reply.complete ? null : el("p", { class: "muted" }, `Grouped from the newest ${reply.scanned} dead jobs.`),
      el("div", { class: "toolbar" }, buttons),
      table(["", "Error (ids and numbers replaced)", "Jobs", "Examples"], rows, { "aria-label": `Error groups of ${queue}` }));
  }

  return { busy, searchPanel, deadGroups };
}
