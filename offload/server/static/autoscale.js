// The dashboard's Autoscaling page: each autoscaled queue (its block, spend, and why the autoscaler does what it
// does), the instances, the providers; and the forms an admin manages them with.
//
// - Provider forms are built from GET /v1/autoscale/provider-types (one labelled field per setting). Secrets come
//   back masked (****1234) and are never put in a field: a secret field left empty keeps the stored value.
//   `local` providers run processes on the control-plane host: the operator manages them from the CLI, so the
//   page lists them read-only and offers mock, runpod and vastai only. So are the providers the operator made
//   with the CLI (`origin: operator`): they receive the operator's secrets, and the API refuses to change them.
// - The queue form edits the autoscale block as PUT /v1/autoscale/queues/{queue} takes it. The server validates
//   (422 lists every problem with its field path) and the page shows each message at its field.
// - The forms live in a container that survives the page's periodic redraws, so typing is never lost; the
//   provider settings redrawn when the type changes keep the values typed in fields both types have.
// Same rules as app.js: the DOM is built with text only (ui.el), the server decides what a key may do.
export function makeAutoscaleView(ui) {
  const { el, api, table, queueLink, enc } = ui;
  const editor = el("div", { id: "as-editor" });
  let types = null; // provider types and their settings, read once

  const money = (v) => (typeof v === "number" ? `$${v.toFixed(4)}` : "—");
  const send = (path, method, body) => api(path, { method, body });
  const done = (text) => { editor.replaceChildren(); ui.showNotice(text); ui.redraw(); };

  // ---- form building blocks -------------------------------------------------------------------------------
  function field(id, label, input, { help, name } = {}) {
    return el("div", { class: "field" }, el("label", { for: id }, label), input,
      help ? el("small", { class: "help" }, help) : null,
      el("span", { class: "field-error", role: "alert", data: { errorFor: name || id } }));
  }
  function showErrors(form, problems) {
    for (const span of form.querySelectorAll(".field-error")) span.textContent = "";
    for (const [name, msg] of problems) {
      const span = form.querySelector(`.field-error[data-error-for="${CSS.escape(name)}"]`)
        || form.querySelector('.field-error[data-error-for="form"]');
      span.textContent = span.textContent ? `${span.textContent}; ${msg}` : msg;
    }
  }
  function apiProblems(e, where) { // ApiError -> [[field name, message]]; `where` maps a server path to a field
    const detail = e.body && e.body.detail;
    if (e.status !== 422 || !detail) return [["form", e.message]];
    const items = Array.isArray(detail) ? detail.map((d) => [d.path || "", d.msg])
      : [[String(detail).split(": ")[0], String(detail).split(": ").slice(1).join(": ")]];
    return items.map(([path, msg]) => {
      const hit = where(path);
      if (!hit) return ["form", `${path}: ${msg}`];
      const [name, rest] = hit; // rest: the part of the path inside the field (scale_up "0.threshold")
      return [name, rest ? `${rest}: ${msg}` : msg];
    });
  }
  const buttons = (submit, onCancel) => el("div", { class: "buttons" },
    el("button", { type: "submit", class: "primary" }, submit),
    el("button", { type: "button", onclick: onCancel, data: { action: "cancel" } }, "Cancel"),
    el("span", { class: "field-error", role: "alert", data: { errorFor: "form" } }));
  function open(form, first) {
    editor.replaceChildren(form);
    form.scrollIntoView({ block: "nearest" });
    const f = form.querySelector(first);
    if (f) f.focus();
  }

  // ---- providers ------------------------------------------------------------------------------------------
  function settingInput(f, value) {
    const id = `pf-${f.name}`;
    const stored = value !== undefined && value !== null;
    if (f.kind === "secret") {
      return el("input", { id, name: f.name, type: "password", autocomplete: "new-password", spellcheck: "false",
        placeholder: stored ? `stored ${value}: leave empty to keep it` : (f.required ? "required" : "") });
    }
    if (f.kind === "bool") return el("input", { id, name: f.name, type: "checkbox", checked: stored ? value : f.default });
    if (f.kind === "choice") {
      return el("select", { id, name: f.name }, f.choices.map((c) => el("option", { value: c,
        selected: c === (stored ? value : f.default) }, c)));
    }
    const text = stored ? (f.kind === "json" ? JSON.stringify(value) : String(value)) : "";
    const hint = f.default === null || f.default === undefined ? "" : `default: ${JSON.stringify(f.default)}`;
    return el("input", { id, name: f.name, type: "text", inputmode: f.kind === "number" ? "decimal" : null,
      value: text, placeholder: hint, spellcheck: "false", autocomplete: "off" });
  }
  // A field redrawn by another one (the settings per provider type) keeps what the person typed in it: the
  // fields they edited are read before the redraw and put back into the new fields of the same name and kind.
  function markTyped(container) {
    const mark = (ev) => { if (ev.target.name) ev.target.dataset.typed = "1"; };
    container.addEventListener("input", mark);
    container.addEventListener("change", mark);
  }
  function typedValues(container) {
    return new Map([...container.querySelectorAll("[data-typed]")].map((i) =>
      [i.name, { tag: i.tagName, type: i.type, value: i.value, checked: i.checked }]));
  }
  function restoreTyped(container, typed) {
    for (const input of container.querySelectorAll("input, select, textarea")) {
      const old = typed.get(input.name);
      if (!old || old.tag !== input.tagName || old.type !== input.type) continue;
      if (input.tagName === "SELECT" && ![...input.options].some((o) => o.value === old.value)) continue;
      if (input.type === "checkbox") input.checked = old.checked; else input.value = old.value;
      input.dataset.typed = "1";
    }
  }
  function readSetting(f, input, original) { // -> [present, value] or throws Error(message)
    if (f.kind === "secret") return input.value === "" ? [false] : [true, input.value];
    if (f.kind === "bool") return [true, input.checked];
    if (f.kind === "choice") return [true, input.value];
    const v = input.value.trim();
    if (v === "") return original === undefined ? [false] : [true, null];
    if (f.kind === "number") {
      const n = Number(v);
      if (!Number.isFinite(n)) throw new Error("not a number");
      return [true, n];
    }
    if (f.kind === "json") {
      try { return [true, JSON.parse(v)]; } catch (_) { throw new Error('not valid JSON (a list is written ["a", "b"])'); }
    }
    return [true, v];
  }
  function providerForm(existing) {
    const creatable = types.filter((t) => !t.operator_only);
    let kind = existing ? existing.type : creatable[0].type;
    const settings = el("div", { class: "fields", id: "pf-settings" });
    const form = el("form", { id: "provider-form", class: "editor", autocomplete: "off" });
    const render = () => {
      const t = types.find((x) => x.type === kind);
      const typed = typedValues(settings);
      settings.replaceChildren(...t.fields.map((f) => field(`pf-${f.name}`, f.required ? `${f.name} (required)` : f.name,
        settingInput(f, existing ? existing.config[f.name] : undefined), { help: f.description, name: f.name })));
      restoreTyped(settings, typed);
    };
    markTyped(settings);
    const typeSelect = el("select", { id: "pf-type", disabled: !!existing,
      onchange: (ev) => { kind = ev.currentTarget.value; render(); } },
    creatable.map((t) => el("option", { value: t.type, selected: t.type === kind }, t.type)));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const t = types.find((x) => x.type === kind);
      const config = {};
      const bad = [];
      for (const f of t.fields) {
        const original = existing ? existing.config[f.name] : undefined;
        try {
          const [present, value] = readSetting(f, form.querySelector(`[name="${CSS.escape(f.name)}"]`), original);
          const changed = !existing || f.kind === "secret" || JSON.stringify(value) !== JSON.stringify(original ?? null);
          if (present && changed && !(existing && value === null && original === undefined)) config[f.name] = value;
        } catch (e) { bad.push([f.name, e.message]); }
      }
      if (bad.length) { showErrors(form, bad); return; }
      const name = existing ? existing.name : form.querySelector("#pf-name").value.trim();
      const where = (path) => (path.startsWith("config.") ? [path.slice(7).split(".")[0], path.slice(7).split(".").slice(1).join(".")]
        : ["name", "type"].includes(path) ? [path, ""] : null);
      try {
        if (existing) await send(`/v1/autoscale/providers/${enc(name)}`, "PATCH", config);
        else await send("/v1/autoscale/providers", "POST", { name, type: kind, config });
        done(`${existing ? "Saved" : "Created"} provider ${name}`);
      } catch (e) { showErrors(form, apiProblems(e, where)); }
    });
    form.append(el("h2", null, existing ? `Edit provider ${existing.name}` : "Add a provider"),
      el("p", { class: "muted" }, existing ? "Secrets are not shown: leave a secret empty to keep the stored one."
        : "Secrets are stored encrypted and never shown again (local providers are set up from the CLI)."),
      el("div", { class: "fields" },
        field("pf-name", "Name", el("input", { id: "pf-name", value: existing ? existing.name : "", disabled: !!existing,
          placeholder: "e.g. gpu-runpod", spellcheck: "false", autocomplete: "off" }), { name: "name" }),
        field("pf-type", "Type", typeSelect, { name: "type" })),
      settings, buttons(existing ? `Save provider ${existing.name}` : "Create provider", () => editor.replaceChildren()));
    render();
    open(form, existing ? "#pf-settings input, #pf-settings select" : "#pf-name");
  }
  const deleteProvider = (p) => ui.action("Delete provider", "admin", async () => {
    await send(`/v1/autoscale/providers/${enc(p.name)}`, "DELETE");
    return `Deleted provider ${p.name}`;
  }, { danger: true, name: "delete-provider", question: `Delete provider ${p.name}? Queues that name it stop renting.` });

  // ---- queue autoscale blocks -----------------------------------------------------------------------------
  const QFIELDS = [
    ["enabled", "Enabled", "bool"], ["providers", "Providers, in order of preference (comma-separated)", "list"],
    ["choose", "Choose the provider", "choice", ["first", "cheapest"]],
    ["min_workers", "Minimum workers", "int"], ["max_workers", "Maximum workers", "int"],
    ["jobs_per_worker", "Jobs per worker (ramp in one step)", "int"], ["poll_interval", "Poll interval (e.g. 30s)", "text"],
    ["boot_timeout", "Boot timeout (e.g. 20m)", "text"], ["drain_timeout", "Drain timeout (e.g. 1h)", "text"],
    ["timezone", "Time zone of the schedules", "text"], ["daily_spend_cap", "Daily spend cap (USD)", "number"],
    ["monthly_spend_cap", "Monthly spend cap (USD)", "number"],
    ["protected_failures", "A protected instance that fails is", "choice", ["keep", "destroy"]],
    ["instance.gpu", "GPU", "text"], ["instance.gpu_count", "GPUs per machine", "int"], ["instance.image", "Image", "text"],
    ["instance.disk_gb", "Disk (GB)", "int"], ["instance.max_price_per_hour", "Max price per hour (USD)", "number"],
    ["instance.spot", "Rent spot (interruptible) machines", "bool"],
    ["instance.spot_max_price", "Spot max price per hour (USD)", "number"],
    ["instance.handler", "Handler (module:function)", "text"], ["instance.env", "Environment (JSON object)", "json"],
    ["scale_up", "Scale-up triggers (JSON list)", "json"], ["scale_down", "Scale-down triggers (JSON list)", "json"],
    ["deployment", "Deployment from git (JSON object; empty: none)", "json"],
  ];
  const PLACEHOLDERS = { min_workers: "0", poll_interval: "30s", boot_timeout: "20m", drain_timeout: "1h",
    timezone: "UTC", "instance.gpu_count": "1", scale_up: '[{"trigger": "no_workers"}]',
    scale_down: '[{"trigger": "idle", "timeout": "10m"}]',
    deployment: '{"git_url": "https://…", "branch": "main", "handler": "app:run"}' };
  const get = (o, path) => path.split(".").reduce((x, k) => (x && typeof x === "object" ? x[k] : undefined), o);
  function put(o, path, v) {
    const keys = path.split(".");
    let x = o;
    for (const k of keys.slice(0, -1)) x = (x[k] ||= {});
    x[keys[keys.length - 1]] = v;
  }
  const fid = (key) => `qf-${key.replace(/\./g, "-")}`;
  function queueInput([key, , kind, choices], block) {
    const id = fid(key);
    let v = key === "providers" ? (block.provider ? [block.provider] : block.providers) : get(block, key);
    if (kind === "bool") return el("input", { id, type: "checkbox", checked: key === "enabled" && v === undefined ? true : !!v });
    if (kind === "choice") return el("select", { id }, choices.map((c) => el("option", { value: c, selected: c === (v ?? choices[0]) }, c)));
    if (kind === "list") v = Array.isArray(v) ? v.join(", ") : v;
    if (kind === "json" && v !== undefined) v = JSON.stringify(v, null, key === "deployment" || key.startsWith("scale") ? 1 : 0);
    const attrs = { id, value: v === undefined || v === null ? "" : String(v), spellcheck: "false", autocomplete: "off",
      placeholder: PLACEHOLDERS[key] || "" };
    if (kind === "json") {
      const t = el("textarea", { id, rows: 3, spellcheck: "false", placeholder: attrs.placeholder });
      t.value = attrs.value;
      return t;
    }
    return el("input", attrs);
  }
  function readQueue(form) {
    const block = {};
    const bad = [];
    for (const [key, , kind] of QFIELDS) {
      const input = form.querySelector(`#${fid(key)}`);
      if (kind === "bool") { if (input.checked || key === "enabled") put(block, key, input.checked); continue; }
      const v = input.value.trim();
      if (v === "") continue;
      if (kind === "list") {
        const names = v.split(",").map((s) => s.trim()).filter(Boolean);
        if (names.length === 1) block.provider = names[0]; else block.providers = names;
      } else if (kind === "int" || kind === "number") {
        const n = Number(v);
        if (!Number.isFinite(n)) bad.push([key, "not a number"]); else put(block, key, n);
      } else if (kind === "json") {
        try { put(block, key, JSON.parse(v)); } catch (_) { bad.push([key, "not valid JSON"]); }
      } else {
        put(block, key, v);
      }
    }
    return { block, bad };
  }
  function queueWhere(queue) { // queues.<q>.autoscale.scale_up.1.threshold -> scale_up
    const prefix = `queues.${queue}.autoscale.`;
    return (path) => {
      if (!path.startsWith(prefix)) return null;
      const rest = path.slice(prefix.length);
      if (rest === "provider" || rest === "providers") return ["providers", ""];
      const key = QFIELDS.map(([k]) => k).filter((k) => rest === k || rest.startsWith(`${k}.`))
        .sort((a, b) => b.length - a.length)[0];
      return key ? [key, rest.slice(key.length + 1)] : null;
    };
  }
  function queueForm(queue, current) {
    const block = (current && current.autoscale) || {};
    const form = el("form", { id: "queue-form", class: "editor", autocomplete: "off" });
    const name = el("input", { id: "qf-queue", value: queue || "", disabled: !!queue, placeholder: "e.g. inference",
      spellcheck: "false", autocomplete: "off" });
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const q = queue || name.value.trim();
      const { block: body, bad } = readQueue(form);
      if (!q) bad.push(["queue", "a queue name is required"]);
      if (bad.length) { showErrors(form, bad); return; }
      try {
        await send(`/v1/autoscale/queues/${enc(q)}`, "PUT", body);
        done(`Saved autoscaling of ${q}`);
      } catch (e) { showErrors(form, apiProblems(e, queueWhere(q))); }
    });
    const remove = current && current.source === "api" ? ui.action(`Remove the dashboard setting of ${queue}`, "admin", async () => {
      await send(`/v1/autoscale/queues/${enc(queue)}`, "DELETE");
      editor.replaceChildren();
      return `Removed the dashboard setting of ${queue}: offload.yaml applies again`;
    }, { danger: true, name: "remove-queue-block",
      question: `Remove the autoscale block of ${queue} set from the dashboard or API? offload.yaml's applies again (none: autoscaling off).` }) : null;
    form.append(el("h2", null, queue ? `Autoscaling of ${queue}` : "Set up autoscaling for a queue"),
      el("p", { class: "muted" }, current && current.source === "offload.yaml"
        ? "This block comes from offload.yaml; saving here overrides it (Remove brings the file's back)."
        : "Empty fields take their defaults. The server checks everything and names any problem at its field."),
      el("div", { class: "fields" }, field("qf-queue", "Queue", name, { name: "queue" }),
        QFIELDS.map((f) => field(fid(f[0]), f[1], queueInput(f, block), { name: f[0] }))),
      buttons(queue ? `Save autoscaling of ${queue}` : "Save autoscaling", () => editor.replaceChildren()),
      ...(remove ? [remove] : []));
    open(form, queue ? `#${fid("max_workers")}` : "#qf-queue");
  }

  // ---- the page -------------------------------------------------------------------------------------------
  function blockSummary(a) {
    if (!a) return "—";
    const names = a.provider ? [a.provider] : a.providers || [];
    const parts = [a.enabled ? "enabled" : "disabled", `provider ${names.join(" → ") || "—"}`,
      `workers ${a.min_workers ?? 0}-${a.max_workers ?? "?"}`];
    if (a.choose === "cheapest") parts.push("cheapest");
    if (a.jobs_per_worker) parts.push(`${a.jobs_per_worker} jobs/worker`);
    if (a.poll_interval !== undefined) parts.push(`poll ${a.poll_interval}`);
    const trig = (list) => (Array.isArray(list) ? list.map((t) => t && t.trigger).filter(Boolean).join("+") : "");
    if (trig(a.scale_up)) parts.push(`up: ${trig(a.scale_up)}`);
    if (trig(a.scale_down)) parts.push(`down: ${trig(a.scale_down)}`);
    if (a.instance && a.instance.gpu) parts.push(`gpu ${a.instance.gpu}`);
    if (a.instance && a.instance.max_price_per_hour !== undefined) parts.push(`≤ $${a.instance.max_price_per_hour}/h`);
    if (a.instance && a.instance.spot) parts.push(`spot ≤ $${a.instance.spot_max_price}/h`);
    if (a.deployment) parts.push(`deploy ${a.deployment.branch || "main"} of ${a.deployment.git_url}`);
    if (a.daily_spend_cap !== undefined && a.daily_spend_cap !== null) parts.push(`day cap $${a.daily_spend_cap}`);
    if (a.monthly_spend_cap !== undefined && a.monthly_spend_cap !== null) parts.push(`month cap $${a.monthly_spend_cap}`);
    return parts.join(" · ");
  }
  const protectButton = (inst) => (inst.status === "terminated" || (inst.status === "failed" && inst.teardown !== "kept") ? null
    : ui.action(inst.protect ? "Unprotect" : "Protect", "admin", async () => {
      const verb = inst.protect ? "unprotect" : "protect";
      await send(`/v1/autoscale/instances/${enc(inst.id)}/${verb}`, "POST");
      return `${inst.protect ? "Unprotected" : "Protected"} ${inst.id}`;
    }, { name: inst.protect ? "unprotect" : "protect" }));
  const fmtConfig = (c) => Object.entries(c || {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(" ");
  const adminButton = (label, name, onclick) => el("button", { type: "button", data: { action: name },
    hidden: !ui.me().can_admin, disabled: !ui.me().can_admin, onclick }, label);

  async function load() {
    if (!ui.me().can_see_workers) return null;
    const [status, configs, providers] = await Promise.all([api("/v1/autoscale/status"), api("/v1/autoscale/queues"),
      api("/v1/autoscale/providers")]);
    if (!types) types = await api("/v1/autoscale/provider-types");
    delete status.server; // which server answered: changes with a balancer, not worth a redraw
    return { status, configs, providers };
  }

  function draw(data) {
    if (data === null) {
      return el("section", null, el("h1", null, "Autoscaling"),
        el("p", { class: "muted" }, "Autoscaling spans every queue: it needs an admin key or an unrestricted viewer key."));
    }
    const { status, configs, providers } = data;
    const names = [...new Set([...Object.keys(configs), ...Object.keys(status.queues)])].sort();
    const queueRows = names.map((q) => {
      const s = status.queues[q] || {};
      const c = configs[q];
      return el("tr", { data: { queue: q } }, el("td", null, queueLink(q)),
        el("td", { data: { col: "config" } }, blockSummary(c && c.autoscale)),
        el("td", { data: { col: "source" } }, c ? c.source : "—"),
        el("td", { class: "num", data: { col: "active" } }, s.active ?? 0),
        el("td", { class: "num", data: { col: "spend-day" } }, money(s.spend_today ?? 0),
          s.dry_run_spend_today ? el("div", { class: "muted" }, `dry run ${money(s.dry_run_spend_today)}`) : null),
        el("td", { class: "num", data: { col: "spend-month" } }, money(s.spend_month ?? 0)),
        el("td", { class: "why", data: { col: "why" } }, el("ul", null, (s.why || ["not evaluated yet"]).map((w) => el("li", null, w)))),
        el("td", { class: "actions" }, adminButton("Edit autoscaling", "edit-queue", () => queueForm(q, c))));
    });
    const instRows = status.instances.map((i) => el("tr", { data: { instance: i.id, status: i.status } },
      el("td", { class: "mono" }, i.id), el("td", null, queueLink(i.queue)), el("td", { data: { col: "provider" } }, i.provider),
      el("td", { data: { col: "status" } }, el("span", { class: `state ${i.status}` }, i.status), i.spot ? " (spot)" : "",
        i.reason ? ` (${i.reason})` : ""),
      el("td", { class: "mono", data: { col: "worker" } }, i.worker_id || "—"),
      el("td", { data: { col: "protected" } }, i.protected ? "yes" : "no"),
      el("td", { class: "num", data: { col: "cost" } }, money(i.cost)),
      el("td", { class: "actions" }, protectButton(i))));
    const provRows = providers.map((p) => {
      const t = types && types.find((x) => x.type === p.type);
      const managed = (t && t.operator_only) || p.origin === "operator";
      return el("tr", { data: { provider: p.name } }, el("td", null, p.name), el("td", null, p.type),
        el("td", { class: "mono", data: { col: "config" } }, fmtConfig(p.config)),
        el("td", { class: "actions" }, managed ? el("span", { class: "muted", data: { col: "managed" } },
          t && t.operator_only ? "runs on this host: managed from the CLI" : "the operator's: managed from the CLI")
          : [adminButton("Edit provider", "edit-provider", () => providerForm(p)), deleteProvider(p)]));
    });
    const leader = status.leader ? `${status.leader.owner} (token ${status.leader.token})` : "none";
    return el("section", null, el("h1", null, "Autoscaling"),
      el("p", { class: "muted", id: "autoscale-leader" }, `Leader: ${leader}`),
      editor, ui.charts.panel("fleet"), // fleet size and cost over time (charts.js)
      el("h2", null, "Queues ", adminButton("Set up autoscaling for a queue", "new-queue", () => queueForm(null, null))),
      names.length ? table(["Queue", "Autoscale", "Source", "Active", "Spend today", "Spend this month",
        "Why (last evaluation)", ""], queueRows, { id: "autoscale-queues" }) : el("p", { class: "empty" }, "No queue has an autoscale block."),
      el("h2", null, "Instances"),
      instRows.length ? table(["Instance", "Queue", "Provider", "Status", "Worker", "Protected", "Cost", ""], instRows,
        { id: "instances" }) : el("p", { class: "empty" }, "No instances."),
      el("h2", null, "Providers ", adminButton("Add a provider", "new-provider", () => providerForm(null))),
      provRows.length ? table(["Name", "Type", "Config (secrets masked)", ""], provRows, { id: "providers" })
        : el("p", { class: "empty" }, "No providers."));
  }

  // While a form is open the page does not redraw under it (focus and half-typed values stay put).
  return { load, draw, busy: () => editor.childElementCount > 0, reset: () => editor.replaceChildren() };
}
