// The dead letter's "Failed webhooks": per queue, the completion webhooks that used up their tries and the number
// still owed (server: routes_callbacks.py); an admin ticks some, or takes all, and requeues them after a confirmation.
//
// Only the receiver's host is shown, and it is all the API gives: a callback URL's path or query may hold the
// receiver's token. Like app.js, the DOM is built with el() only (errors are text, never markup); the ticked rows
// live here, per queue, so the page's redraws keep them.
const LIMIT = 50; // newest dead-lettered webhooks listed per queue; "Requeue all" takes every one

export function makeCallbacks({ el, api, table, enc, jobLink, queueLink, fmtTime, ask, showNotice, showError, me, redraw }) {
  const picked = {}; // queue -> Set of the job ids ticked

  // Every queue's dead-lettered webhooks; one that cannot be read says why instead of hiding the others.
  async function load(queues) {
    const pages = await Promise.all(queues.map((q) => api(`/v1/queues/${enc(q)}/callbacks/failed?limit=${LIMIT}`)
      .then((page) => ({ queue: q, ...page }), (e) => ({ queue: q, failed: [], owed: 0, problem: e.message }))));
    return pages.filter((p) => p.failed.length || p.owed || p.problem);
  }

  function requeue(queue, label, body, question) {
    const allowed = me().can_admin;
    return el("button", { type: "button", hidden: !allowed, disabled: !allowed,
      data: { action: body.all ? "requeue-webhooks-all" : "requeue-webhooks" },
      onclick: async (ev) => {
        const btn = ev.currentTarget;
        if ((body.ids && !body.ids.length) || !(await ask(question(), label))) return;
        btn.disabled = true;
        try {
          const { moved } = await api(`/v1/queues/${enc(queue)}/callbacks/failed/requeue`, { method: "POST", body });
          picked[queue]?.clear();
          showNotice(`Requeued ${moved.length} webhook${moved.length === 1 ? "" : "s"} of ${queue}`);
        } catch (e) {
          showError(e);
        } finally {
          redraw();
        }
      } }, label);
  }

  function queueBlock(s) {
    const sel = (picked[s.queue] ||= new Set());
    for (const id of [...sel]) if (!s.failed.some((f) => f.job_id === id)) sel.delete(id); // requeued meanwhile
    const admin = me().can_admin;
    const ids = [...sel];
    const some = requeue(s.queue, "Requeue selected", { ids }, () =>
      `Send ${ids.length} webhook${ids.length === 1 ? "" : "s"} of queue ${s.queue} again with a fresh budget of tries?`);
    some.disabled = some.disabled || !sel.size;
    const all = requeue(s.queue, "Requeue all webhooks", { all: true }, () =>
      `Send every dead-lettered webhook of queue ${s.queue} again with a fresh budget of tries?`);
    const tick = (f) => el("input", { type: "checkbox", checked: sel.has(f.job_id), "aria-label": `Select webhook of ${f.job_id}`,
      onchange: (ev) => {
        if (ev.target.checked) sel.add(f.job_id); else sel.delete(f.job_id);
        ids.splice(0, ids.length, ...sel);
        some.disabled = !sel.size;
      } });
    const rows = s.failed.map((f) => el("tr", { data: { job: f.job_id } }, admin ? el("td", null, tick(f)) : null,
      el("td", null, jobLink(f.job_id)), el("td", { class: "mono", data: { col: "host" } }, f.host || "—"),
      el("td", { class: "num", data: { col: "tries" } }, f.tries), el("td", { class: "err" }, f.error),
      el("td", { data: { col: "failed-at" } }, fmtTime(f.failed_at))));
    const heads = [...(admin ? [""] : []), "Job", "Receiver host", "Tries", "Last error", "Dead-lettered"];
    return el("section", { class: "set cb", data: { callbacks: s.queue } },
      el("h3", null, queueLink(s.queue), ` · ${s.failed.length}${s.failed.length === LIMIT ? "+" : ""} failed · `,
        el("span", { data: { owed: s.queue } }, `${s.owed} owed`)),
      s.problem ? el("p", { class: "error" }, s.problem) : !s.failed.length ? null : [el("div", { class: "toolbar" }, some, all),
        table(heads, rows, { "aria-label": `Failed webhooks of ${s.queue}` }),
        s.failed.length === LIMIT ? el("p", { class: "muted" }, `The newest ${LIMIT}; requeue all takes every one.`) : null]);
  }

  function section(sets) {
    if (!sets.length) return null;
    return el("section", { class: "callbacks", "aria-label": "Failed webhooks" }, el("h2", null, "Failed webhooks"),
      el("p", { class: "muted" }, "Completion webhooks that used up their tries (callbacks.max_tries), with the reason " +
        "of the last; owed counts those not yet delivered. Requeue sends them again with a fresh budget of tries."),
      sets.map(queueBlock));
  }

  return { load, section };
}
