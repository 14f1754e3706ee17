// A queue's spend per kind of capacity (server: QueueView.spend, offload/autoscale/fleet_idle.py): serverless (API
// runs), fleet (GPU-worker runs: run time x their machine's price) and fleet idle (the rental the jobs did not use).
// A GPU worker that is no rented machine has no price: its runs show "price unknown", never $0.
const KINDS = [["serverless", "Serverless"], ["fleet", "Fleet"], ["fleet_idle", "Fleet idle"]];

// Cents for most spend, more digits for the fractions of a cent a few seconds of a machine cost.
export const usd = (v) => `$${v >= 1 || v === 0 ? v.toFixed(2) : v.toFixed(4)}`;

function amount(q, spend, kind) {
  const v = spend[kind];
  const unpriced = kind === "fleet" ? (q.totals.fleet_unpriced || 0) : 0;
  if (unpriced && !v) return "price unknown";
  if (v === undefined) return null;
  return unpriced ? `${usd(v)} + price unknown` : usd(v);
}

// One line for the queue list: the kinds the queue spent on today (the job store's UTC day).
export function spendText(q) {
  const parts = KINDS.map(([kind, label]) => [label.toLowerCase(), amount(q, q.spend, kind)]).filter(([, v]) => v);
  return parts.length ? parts.map(([label, v]) => `${label} ${v}`).join(" · ") : "—";
}

// The queue page's table: each kind, today and since the queue began.
export function spendTable(q, el) {
  const rows = KINDS.map(([kind, label]) => el("tr", { data: { kind } }, el("th", { scope: "row" }, label),
    el("td", { class: "num", data: { col: "today" } }, amount(q, q.spend, kind) ?? "—"),
    el("td", { class: "num", data: { col: "total" } }, amount(q, q.spend_total, kind) ?? "—")));
  return el("table", { id: "spend", "aria-label": "Spend by kind of capacity" },
    el("thead", null, el("tr", null, el("th", null, "Kind"), el("th", null, "Today (UTC)"), el("th", null, "All time"))),
    el("tbody", null, rows));
}
