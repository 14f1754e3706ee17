// The dashboard's DOM builders, shared by its modules (app.js, charts.js).
//
// Job data, queue and backend names are user data: el() sets text only (textContent / text nodes), never
// innerHTML, and links pass safeHref (http, https or an in-page #route). The tests hold the pages to it.
export function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "href") node.setAttribute("href", safeHref(v));
    else if (k === "data") for (const [dk, dv] of Object.entries(v)) node.dataset[dk] = String(dv);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}

export function safeHref(v) {
  const s = String(v);
  if (s.startsWith("#")) return s;
  try {
    const u = new URL(s, location.href);
    if (u.protocol === "http:" || u.protocol === "https:") return u.href;
  } catch (_) { /* not a URL */ }
  return "#";
}

export const table = (heads, rows, attrs) => el("table", attrs,
  el("thead", null, el("tr", null, heads.map((h) => el("th", null, h)))), el("tbody", null, rows));
