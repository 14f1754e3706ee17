// A job's story on its page (server: GET /v1/jobs/{id}/attempts): every attempt (who claimed it, where it ran,
// how its end was learnt, how long, what it cost, how it ended and why), the job's files and its events.
// Like app.js, the DOM is built with el() only: errors, ids and file names are text, never markup. A provider's
// console link is the server's (built from the remote id alone, Replicate's own API only), opened with noopener.
import { usd } from "./spend.js";

function duration(ms) {
  if (ms === null || ms === undefined) return "—";
  if (ms < 1000) return `${ms} ms`;
  const s = ms / 1000;
  return s < 120 ? `${s.toFixed(1)} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}

export function makeStory({ el, table, enc, fmtTime }) {
  const load = (api, id) => api(`/v1/jobs/${enc(id)}/attempts`);

  function remote(a) {
    if (!a.remote_id) return "—";
    const how = a.resumed ? " (resumed)" : a.adopted ? " (adopted)" : "";
    const link = a.console_url
      ? [" ", el("a", { href: a.console_url, target: "_blank", rel: "noopener noreferrer", class: "console" }, "console")]
      : null;
    return [el("span", { class: "mono" }, a.remote_id), how, link];
  }

  function attemptRow(a) {
    const outcome = a.outcome || "running";
    return el("tr", { data: { attempt: a.number, outcome } },
      el("td", { class: "num" }, a.number),
      el("td", { class: "mono", title: a.token ? `lease token ${a.token}` : null }, a.claimed_by),
      el("td", null, a.backend || "—"), el("td", null, remote(a)), el("td", null, a.learned_by || "—"),
      el("td", null, fmtTime(a.claimed_at)), el("td", { class: "num" }, duration(a.duration_ms)),
      el("td", { class: "num" }, a.cost === null || a.cost === undefined ? "—" : usd(a.cost)),
      el("td", null, el("span", { class: `state ${outcome.replace(" ", "-")}` }, outcome)),
      el("td", { class: "err" }, a.error || ""));
  }

  function attempts(story) {
    if (!story.attempts.length) return el("p", { class: "muted" }, "No attempt yet: no worker has claimed this job.");
    const dropped = story.made - story.attempts.length;
    return [table(["#", "Claimed by", "Backend", "Remote id", "Learned by", "Started", "Duration", "Cost", "Outcome",
      "Error"], story.attempts.map(attemptRow), { id: "attempts", "aria-label": "Attempts" }),
    dropped > 0 ? el("p", { class: "muted" }, `${story.made} attempts: the first 5 and the last 45 are kept, ` +
      `${dropped} in between are not.`) : null];
  }

  // The object keys the job's input and output refer to, with a presigned link where the server gave one.
  function files(job) {
    const urls = job.file_urls || {};
    const keys = [...new Set([...(job.files || []), ...Object.keys(urls)])];
    if (!keys.length) return el("p", { class: "muted" }, "No files.");
    return el("ul", { id: "job-files", "aria-label": "Files" }, keys.map((k) => el("li", null,
      urls[k] ? el("a", { href: urls[k], target: "_blank", rel: "noopener noreferrer", class: "mono" }, k)
        : el("span", { class: "mono" }, k))));
  }

  function events(story) {
    if (!story.events.length) return el("p", { class: "muted" }, "None among the queue's latest 1,000 events.");
    return table(["When", "Event", "Detail"], story.events.map((e) => el("tr", { data: { event: e.state } },
      el("td", null, fmtTime(e.at)), el("td", null, e.state),
      el("td", null, Object.entries(e.detail).map(([k, v]) => `${k}: ${v}`).join(" · ")))),
    { id: "job-events", "aria-label": "Events" });
  }

  const draw = (job, story) => [el("h2", null, "Attempts"), attempts(story), el("h2", null, "Files"), files(job),
    el("h2", null, "Events"), events(story)];

  return { load, draw };
}
