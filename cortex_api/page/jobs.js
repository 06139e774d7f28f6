// The jobs dashboard: polls GET /v1/jobs with the chosen filters (there is no feed of every
// job's changes; one page of summaries is a single pipelined Redis read) and redraws the
// table. Filters and the page live in the URL, so a view can be shared or reloaded.
"use strict";
(function () {
  const C = window.Cortex;
  const { el, fmtTime, fmtDuration, TERMINAL_JOB, ACTION_STATUSES } = C;
  const $ = (id) => document.getElementById(id);
  const config = JSON.parse($("cx-config").textContent);
  const POLL_MS = 2000;
  const LIMIT = 50;

  const query = new URLSearchParams(window.location.search);
  const view = { status: query.get("status") || "", agent: query.get("agent") || "",
                 offsets: [0], next: null };
  let generation = 0;  // bumped by every filter or page change: older answers are dropped
  let inflight = false;
  let clockOffset = 0;  // server seconds - browser seconds (from the Date header)
  let lastItems = null;

  function listUrl() {
    const q = new URLSearchParams({ limit: String(LIMIT), offset: String(view.offsets[view.offsets.length - 1]) });
    if (view.status) q.set("status", view.status);
    if (view.agent) q.set("agent", view.agent);
    return "v1/jobs?" + q.toString();
  }

  async function poll() {
    if (inflight || document.hidden) return;
    inflight = true;
    const mine = generation;
    const answer = await C.api("GET", listUrl());
    inflight = false;
    if (mine !== generation) { poll(); return; }
    const error = $("list-error");
    if (!answer.ok) {
      error.hidden = false;
      error.textContent = "Cannot list the jobs: " + C.message(answer);
      $("conn").textContent = "retrying…";
      return;
    }
    error.hidden = true;
    if (!isNaN(answer.date)) clockOffset = answer.date / 1000 - Date.now() / 1000;
    view.next = answer.body.next_offset;
    lastItems = answer.body.items;
    $("conn").textContent = "live · updated " + new Date().toLocaleTimeString();
    render();
  }

  function render() {
    const items = lastItems || [];
    const now = Date.now() / 1000 + clockOffset;
    const body = $("rows");
    const keep = new Set(items.map((job) => job.id));
    for (const [id, r] of rows) if (!keep.has(id)) { r.tr.remove(); rows.delete(id); }
    for (const job of items) body.appendChild(row(job, now));  // appending moves it in order
    $("empty").hidden = lastItems === null || items.length > 0;
    const first = view.offsets[view.offsets.length - 1];
    const running = items.filter((j) => !TERMINAL_JOB.has(j.status)).length;
    $("summary").textContent = items.length
      ? "jobs " + (first + 1) + "–" + (first + items.length) + ", newest first · " + running + " not ended"
      : "";
    $("newer").disabled = view.offsets.length === 1;
    $("older").disabled = view.next === null || view.next === undefined;
  }

  // A row per job, kept while it is listed; a cell is redrawn only when what it shows has
  // changed (a row rebuilt every second would swallow a click on its link).
  const rows = new Map();  // job id -> {tr, cells: field -> td, shown: field -> key}
  const FIELDS = ["status", "job", "kind", "agent", "started", "duration", "actions", "error"];
  function row(job, now) {
    let r = rows.get(job.id);
    if (!r) {
      r = { tr: el("tr", { "data-id": job.id }), cells: {}, shown: {} };
      for (const field of FIELDS) r.cells[field] = r.tr.appendChild(el("td", { "data-field": field }));
      r.cells.started.className = r.cells.duration.className = "num";
      r.cells.error.className = "err";
      rows.set(job.id, r);
    }
    r.tr.setAttribute("data-status", job.status);
    const end = job.finished_at || (TERMINAL_JOB.has(job.status) ? null : now);
    const set = (field, key, content) => {
      if (r.shown[field] === key) return;
      r.shown[field] = key;
      const td = r.cells[field];
      if (content instanceof Node) td.replaceChildren(content); else td.textContent = content ?? "–";
    };
    set("status", job.status, el("span", { class: "badge small", "data-status": job.status }, job.status));
    if (!r.shown.job) {
      const link = el("a", { href: C.withKey("jobs/" + encodeURIComponent(job.id)), title: job.id });
      link.appendChild(el("code", {}, job.id.length > 14 ? job.id.slice(0, 12) + "…" : job.id));
      set("job", job.id, link);
    }
    set("kind", job.kind, job.kind);
    set("agent", job.agent, job.agent);
    const started = job.started_at ? fmtTime(job.started_at) : "not yet";
    set("started", started, started);
    const duration = job.started_at && end ? fmtDuration(end - job.started_at) : "–";
    set("duration", duration, duration);
    const counts = job.counts || {};
    set("actions", JSON.stringify(counts), mix(counts));
    set("error", job.error || "", job.error || "");
    r.cells.error.title = job.error || "";
    return r.tr;
  }

  // Action counts: a bar with a segment per status, and the numbers.
  function mix(counts) {
    const box = el("span", { class: "mix-cell" });
    const total = counts.total || 0;
    if (!total) { box.textContent = "–"; return box; }
    const bar = box.appendChild(el("span", { class: "mix" }));
    const parts = [];
    for (const status of ACTION_STATUSES) {
      const n = counts[status];
      if (!n) continue;
      bar.appendChild(el("i", { style: "width: " + (100 * n / total) + "%; background: var(--" + status + ")",
                                title: n + " " + status }));
      parts.push(n + " " + status.replace("_", " "));
    }
    box.appendChild(el("span", {}, total + " · " + parts.join(", ")));
    return box;
  }

  async function loadAgents() {
    const answer = await C.api("GET", "v1/agents");
    const names = answer.ok ? answer.body.items.map((a) => a.name) : [];
    if (view.agent && !names.includes(view.agent)) names.push(view.agent);
    const select = $("agent");
    for (const name of names.sort()) select.appendChild(el("option", { value: name }, name));
    select.value = view.agent;
  }

  function changed() {
    generation += 1;
    const q = new URLSearchParams(window.location.search);
    for (const key of ["status", "agent"]) { if (view[key]) q.set(key, view[key]); else q.delete(key); }
    const text = q.toString();
    history.replaceState(null, "", window.location.pathname + (text ? "?" + text : ""));
    lastItems = null;
    render();  // empty until the answer for the new filters arrives
    $("conn").textContent = "loading…";
    poll();
  }

  // -- start -------------------------------------------------------------------------------
  if (config.flower_url) { $("flower").href = config.flower_url; $("flower").hidden = false; }
  $("status").value = view.status;
  $("status").addEventListener("change", () => { view.status = $("status").value; view.offsets = [0]; changed(); });
  $("agent").addEventListener("change", () => { view.agent = $("agent").value; view.offsets = [0]; changed(); });
  $("filters").addEventListener("submit", (e) => e.preventDefault());
  $("older").addEventListener("click", () => { view.offsets.push(view.next); changed(); });
  $("newer").addEventListener("click", () => { view.offsets.pop(); changed(); });
  document.addEventListener("visibilitychange", poll);
  loadAgents();
  poll();
  setInterval(poll, POLL_MS);
  setInterval(() => { if (lastItems) render(); }, 1000);  // durations of jobs still running
})();
