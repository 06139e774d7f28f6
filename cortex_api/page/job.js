// The job page: one GET of the job, then its event log over SSE (replayed from the start, then
// live; EventSource resumes with Last-Event-ID by itself). Every string goes in as text.
"use strict";
(function () {
  const config = JSON.parse(document.getElementById("cx-config").textContent);
  const jobId = config.job_id;
  const dockerTools = new Set(config.docker_tools || []);
  const apiBase = "../v1/jobs/" + encodeURIComponent(jobId);
  // With API keys configured the page is opened as /jobs/<id>?api_key=<key>: the same key
  // goes to the job JSON (as a header) and to the event stream (EventSource sets no headers).
  const apiKey = new URLSearchParams(window.location.search).get("api_key");
  const keyHeaders = apiKey ? { "X-API-Key": apiKey } : {};
  const keyQuery = apiKey ? "?api_key=" + encodeURIComponent(apiKey) : "";
  const SVG = "http://www.w3.org/2000/svg";
  const TERMINAL_JOB = new Set(["completed", "failed", "cancelled"]);
  const TERMINAL_ACTION = new Set(["ok", "error", "timeout", "skipped", "cancelled"]);
  const RANK = { pending: 0, waiting: 1, queued: 2, running: 3 };
  const JOB_RANK = { loading: -1, queued: 0, running: 1, finishing: 2 };
  const POOLS = ["agent", "tool", "docker", "llm", "relic"];
  const TYPE_POOL = { tool: "tool", llm: "llm", agent: "agent", relic: "relic", workflow: "agent", internal: "agent" };

  const job = { status: "loading", kind: null, agent: null, created: null, started: null,
                finished: null, error: null, turns: null };
  const actions = new Map();  // id -> action state, in the order first seen
  let lastSeq = 0;
  let clockOffset = null;  // server seconds - browser seconds (estimated from live events)
  let structureDirty = true;
  let pending = false;
  let source = null;
  let ticker = null;

  // -- small DOM helpers (text only) -------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  const now = () => Date.now() / 1000 + (clockOffset || 0);
  const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");
  function fmtDuration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
    return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  }

  // -- state -------------------------------------------------------------------------------
  function action(id) {
    let a = actions.get(id);
    if (!a) {
      a = { id: id, type: null, name: null, mode: null, status: "pending", deps: new Set(),
            after: new Set(), queued: null, started: null, finished: null, attempts: 0, error: null };
      actions.set(id, a);
      structureDirty = true;
    }
    return a;
  }
  function setStatus(a, status) {
    if (TERMINAL_ACTION.has(a.status) && !TERMINAL_ACTION.has(status)) return;
    a.status = status;
  }
  function setJobStatus(status) {
    if (!status || TERMINAL_JOB.has(job.status)) return;
    if (!TERMINAL_JOB.has(status) && (JOB_RANK[status] ?? 0) < (JOB_RANK[job.status] ?? -1)) return;
    job.status = status;
  }
  function addDeps(a, deps, after) {
    for (const d of deps || []) if (!a.deps.has(d)) { a.deps.add(d); structureDirty = true; }
    for (const d of after || []) if (!a.after.has(d)) { a.after.add(d); structureDirty = true; }
  }
  function pool(a) {
    if (a.type === "tool" && dockerTools.has(a.name)) return "docker";
    return TYPE_POOL[a.type] || "tool";
  }

  // The job JSON (GET /v1/jobs/{id}): full dependency lists, times, statuses.
  function mergeJob(view) {
    job.kind = view.kind || job.kind;
    job.agent = view.agent || job.agent;
    job.created = view.created_at || job.created;
    job.started = job.started || view.started_at;
    job.finished = job.finished || view.finished_at;
    job.error = job.error || view.error;
    job.turns = view.turns || job.turns;
    setJobStatus(view.status);
    for (const v of view.actions || []) {
      const a = action(v.id);
      a.type = a.type || v.type; a.name = a.name || v.name; a.mode = a.mode || v.mode;
      addDeps(a, v.depends_on, v.after);
      const rank = (s) => (TERMINAL_ACTION.has(s) ? 9 : RANK[s] ?? 0);
      if (rank(v.status) > rank(a.status)) a.status = v.status;
      a.started = a.started || v.started_at;
      a.finished = a.finished || v.finished_at;
      a.error = a.error || v.error;
      a.attempts = Math.max(a.attempts, v.attempts || 0);
    }
    schedule();
  }

  function load() {
    fetch(apiBase, { headers: Object.assign({ Accept: "application/json" }, keyHeaders) }).then((r) => {
      const date = Date.parse(r.headers.get("Date") || "");
      if (!isNaN(date) && clockOffset === null) clockOffset = date / 1000 - Date.now() / 1000;
      if (r.status === 404) { job.error = "This job does not exist (or it expired)."; schedule(); return null; }
      return r.ok ? r.json() : null;
    }).then((view) => { if (view) mergeJob(view); }).catch(() => {});
  }

  // -- events ------------------------------------------------------------------------------
  const stream = { open: null };  // the thought or response block being written
  function streamBlock(kind, final) {
    const box = $("stream");
    const empty = $("stream-empty");
    if (empty) empty.remove();
    const block = el("div", { class: "block " + kind + (final ? " final" : "") });
    block.appendChild(el("span", { class: "label" }, kind));
    const body = el("span", { class: "text" });
    block.appendChild(body);
    box.appendChild(block);
    return { kind: kind, node: block, body: body, final: !!final, ended: false };
  }
  function streamNote(cls, text) {
    const empty = $("stream-empty");
    if (empty) empty.remove();
    $("stream").appendChild(el("div", { class: cls }, text));
    stream.open = null;
  }
  const unrendered = [];  // response blocks waiting for their response_end, in order
  function follow(box, fn) {
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    fn();
    if (atEnd) box.scrollTop = box.scrollHeight;
  }

  function onEvent(ev) {
    if (typeof ev.seq === "number") {
      if (ev.seq <= lastSeq) return;
      lastSeq = ev.seq;
    }
    const d = ev.data || {};
    const offset = ev.ts - Date.now() / 1000;
    if (clockOffset === null || offset > clockOffset) clockOffset = offset;
    switch (ev.type) {
      case "job_queued": job.kind = d.kind || job.kind; job.agent = d.agent || job.agent;
        job.created = job.created || ev.ts; setJobStatus("queued"); break;
      case "job_started": job.started = job.started || ev.ts; job.agent = d.agent || job.agent;
        setJobStatus("running"); break;
      case "turn_started": job.turns = d.turn; setJobStatus("running"); break;
      case "job_completed": case "job_failed": case "job_cancelled":
        job.status = d.status || ev.type.slice(4);
        job.finished = ev.ts;
        job.error = d.error || d.reason || null;
        end();
        break;
      case "action_parsed": {
        const spec = d.action || {};
        const a = action(spec.id);
        a.type = spec.type; a.name = spec.name; a.mode = spec.mode;
        addDeps(a, spec.depends_on, []);
        follow($("stream"), () => streamNote("chip", "action " + spec.id + " · " + spec.type + " " + spec.name));
        break;
      }
      case "action_queued": { const a = action(d.action_id); setStatus(a, "queued");
        if (a.queued === null) a.queued = ev.ts; break; }
      case "action_started": { const a = action(d.action_id); setStatus(a, "running");
        if (a.started === null) a.started = ev.ts; a.attempts = d.attempt || a.attempts; break; }
      case "action_retrying": setStatus(action(d.action_id), "queued"); break;
      case "action_completed": case "action_failed": { const a = action(d.action_id);
        setStatus(a, d.status || (ev.type === "action_completed" ? "ok" : "error"));
        a.finished = ev.ts; a.error = d.error || null; break; }
      case "action_skipped": { const a = action(d.action_id); setStatus(a, "skipped");
        a.error = d.reason || null; break; }
      case "action_cancelled": { const a = action(d.action_id); setStatus(a, "cancelled");
        a.finished = a.started ? ev.ts : a.finished; break; }
      case "thought_chunk": follow($("stream"), () => {
        if (!stream.open || stream.open.kind !== "thought" || stream.open.ended) stream.open = streamBlock("thought");
        stream.open.body.textContent += d.text || "";
      }); break;
      case "thought_end": follow($("stream"), () => {
        if (!stream.open || stream.open.kind !== "thought") stream.open = streamBlock("thought");
        stream.open.body.textContent = d.text || "";
        stream.open.ended = true;
        stream.open = null;
      }); break;
      case "response_chunk": follow($("stream"), () => {
        const open = stream.open;
        if (!open || open.kind !== "response" || open.final !== !!d.final) {
          stream.open = streamBlock("response", d.final);
          unrendered.push(stream.open);
        }
        stream.open.body.textContent += d.text || "";
      }); break;
      case "response_end": follow($("stream"), () => {
        const block = unrendered.shift() || streamBlock("response", d.final);
        block.body.textContent = d.text || "";
        block.node.classList.add("rendered");
        if (stream.open === block) stream.open = null;
      }); break;
      case "text": if ((d.text || "").trim()) stream.open = null; break;
      case "protocol_error": case "warning":
        follow($("stream"), () => streamNote("note", ev.type.replace("_", " ") + ": " + (d.message || d.kind || "")));
        break;
      default: break;
    }
    schedule();
  }

  const EVENT_TYPES = ["job_queued", "job_started", "turn_started", "usage", "turn_completed",
    "child_job", "job_completed", "job_failed", "job_cancelled", "text", "thought_chunk",
    "thought_end", "response_chunk", "response_end", "context_feed", "action_parsed",
    "protocol_error", "warning", "action_queued", "action_started", "action_retrying",
    "action_completed", "action_failed", "action_skipped", "action_cancelled"];

  function connect() {
    source = new EventSource(apiBase + "/events" + keyQuery);
    const handler = (message) => {
      try { onEvent(JSON.parse(message.data)); } catch (err) { console.error(err); }
    };
    for (const type of EVENT_TYPES) source.addEventListener(type, handler);
    source.onmessage = handler;
    source.onopen = () => setConn("live");
    source.onerror = () => {
      if (TERMINAL_JOB.has(job.status)) return;
      setConn(source.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting…");
    };
  }
  function setConn(text) { $("conn").textContent = text; }

  function end() {
    if (source) source.close();  // the server ends the stream here; do not reconnect
    setConn("ended");
    if (ticker) { clearInterval(ticker); ticker = null; }
    load();  // the final state (implicit dependencies, times)
  }

  // -- rendering ---------------------------------------------------------------------------
  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; render(); });
  }
  function render() {
    renderHeader();
    renderDag();
    renderGantt();
  }

  function renderHeader() {
    const badge = $("job-status");
    badge.textContent = job.status;
    badge.setAttribute("data-status", job.status);
    document.title = "Cortex · " + job.status + " · job " + jobId;
    const end = job.finished || (job.started && !TERMINAL_JOB.has(job.status) ? now() : null);
    const rows = [["kind", job.kind], ["agent", job.agent], ["turns", job.turns],
                  ["created", fmtTime(job.created)], ["started", fmtTime(job.started)],
                  ["finished", fmtTime(job.finished)],
                  ["duration", job.started && end ? fmtDuration(end - job.started) : null]];
    const meta = $("job-meta");
    meta.replaceChildren();
    for (const [k, v] of rows) {
      if (v === null || v === undefined) continue;
      const row = el("div");
      row.appendChild(el("dt", {}, k));
      row.appendChild(el("dd", { "data-field": k }, v));
      meta.appendChild(row);
    }
    const error = $("job-error");
    error.hidden = !job.error;
    error.textContent = job.error || "";
    const counts = {};
    for (const a of actions.values()) counts[a.status] = (counts[a.status] || 0) + 1;
    $("counts").textContent = actions.size ? "· " + actions.size + " (" +
      Object.entries(counts).map(([s, n]) => n + " " + s).join(", ") + ")" : "";
  }

  // DAG: columns by wave (longest path from a root), rows in the order actions were seen.
  let dagLayout = null;
  function layoutDag() {
    const wave = new Map();
    const visiting = new Set();
    const depth = (a) => {
      if (wave.has(a.id)) return wave.get(a.id);
      if (visiting.has(a.id)) return 0;  // never happens in a valid plan
      visiting.add(a.id);
      let w = 0;
      for (const d of [...a.deps, ...a.after]) {
        const dep = actions.get(d);
        if (dep) w = Math.max(w, depth(dep) + 1);
      }
      visiting.delete(a.id);
      wave.set(a.id, w);
      return w;
    };
    const columns = [];
    for (const a of actions.values()) {
      const w = depth(a);
      (columns[w] = columns[w] || []).push(a.id);
    }
    const W = 150, H = 38, GX = 56, GY = 14, PAD = 8;
    const pos = new Map();
    let rows = 0;
    columns.forEach((ids, c) => {
      (ids || []).forEach((id, r) => pos.set(id, { x: PAD + c * (W + GX), y: PAD + r * (H + GY) }));
      rows = Math.max(rows, (ids || []).length);
    });
    return { pos: pos, W: W, H: H, width: PAD * 2 + columns.length * (W + GX) - GX,
             height: PAD * 2 + rows * (H + GY) - GY };
  }
  function renderDag() {
    if (!actions.size) return;
    if (structureDirty || !dagLayout) { dagLayout = layoutDag(); structureDirty = false; }
    const { pos, W, H, width, height } = dagLayout;
    const root = svg("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height,
                              role: "img", "aria-label": "action graph" });
    const defs = svg("defs");
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 8 8", refX: 8, refY: 4,
                                   markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
    marker.appendChild(svg("path", { d: "M0,0 L8,4 L0,8 z", fill: "#94a3b8" }));
    defs.appendChild(marker);
    root.appendChild(defs);
    for (const a of actions.values()) {
      const to = pos.get(a.id);
      for (const [set, cls] of [[a.deps, "edge"], [a.after, "edge after"]]) {
        for (const d of set) {
          const from = pos.get(d);
          if (!from || (cls === "edge after" && a.deps.has(d))) continue;
          const x1 = from.x + W, y1 = from.y + H / 2, x2 = to.x, y2 = to.y + H / 2;
          const mx = (x1 + x2) / 2;
          root.appendChild(svg("path", { class: cls, "marker-end": "url(#arrow)",
            d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2 - 1},${y2}` }));
        }
      }
    }
    for (const a of actions.values()) {
      const p = pos.get(a.id);
      const g = svg("g", { class: "node s-" + a.status, "data-id": a.id, "data-status": a.status,
                           transform: `translate(${p.x},${p.y})` });
      g.appendChild(svg("title", {}, a.id + " · " + (a.type || "?") + " " + (a.name || "") + " · " +
                                     a.status + (a.error ? " · " + a.error : "")));
      g.appendChild(svg("rect", { width: W, height: H, rx: 6 }));
      g.appendChild(svg("text", { class: "id", x: 8, y: 15 }, clip(a.id, 22)));
      g.appendChild(svg("text", { class: "name", x: 8, y: 30 }, clip((a.name || "") + " · " + a.status, 24)));
      root.appendChild(g);
    }
    $("dag").replaceChildren(root, legend());
  }
  function clip(text, n) { text = String(text); return text.length > n ? text.slice(0, n - 1) + "…" : text; }
  function legend() {
    const box = el("div", { class: "legend" });
    for (const s of ["pending", "queued", "running", "ok", "error", "timeout", "skipped", "cancelled"]) {
      const item = el("span");
      item.appendChild(el("i", { style: "background: var(--" + s + ")" }));
      item.appendChild(document.createTextNode(s));
      box.appendChild(item);
    }
    return box;
  }

  // Gantt: a lane per pool; overlapping bars of a lane go on separate rows.
  function renderGantt() {
    const bars = [...actions.values()].filter((a) => a.started);
    if (!bars.length) return;
    const t = now();
    const end = (a) => a.finished || (TERMINAL_ACTION.has(a.status) ? a.started : (job.finished || t));
    let t0 = Math.min(...bars.map((a) => a.queued || a.started));
    if (job.started && job.started < t0) t0 = job.started;
    let t1 = Math.max(...bars.map(end), job.finished || (TERMINAL_JOB.has(job.status) ? 0 : t));
    if (t1 - t0 < 0.5) t1 = t0 + 0.5;
    const lanes = [];
    for (const name of POOLS) {
      const from = (a) => Math.min(a.queued || a.started, a.started);  // the wait line too
      const mine = bars.filter((a) => pool(a) === name).sort((a, b) => from(a) - from(b));
      if (!mine.length) continue;
      const rowEnds = [];
      const placed = mine.map((a) => {
        let r = rowEnds.findIndex((e) => e <= from(a));
        if (r < 0) { r = rowEnds.length; rowEnds.push(0); }
        rowEnds[r] = end(a);
        return { a: a, row: r };
      });
      lanes.push({ name: name, rows: rowEnds.length, placed: placed });
    }
    const box = $("gantt");
    const width = Math.max(box.clientWidth || 0, 480);
    const LABEL = 64, ROW = 20, LANE_PAD = 6, TOP = 18;
    const plot = width - LABEL - 80;  // room on the right for the last bar's label
    const x = (s) => LABEL + ((s - t0) / (t1 - t0)) * plot;
    let height = TOP;
    for (const lane of lanes) height += lane.rows * ROW + LANE_PAD * 2;
    const root = svg("svg", { width: width, height: height + 4, role: "img", "aria-label": "timeline" });
    const step = niceStep((t1 - t0) / 8);
    for (let s = 0; s <= t1 - t0 + 1e-9; s += step) {
      root.appendChild(svg("line", { class: "axis", x1: x(t0 + s), x2: x(t0 + s), y1: TOP - 4, y2: height }));
      root.appendChild(svg("text", { class: "tick", x: x(t0 + s) + 2, y: 11 }, fmtTick(s, step)));
    }
    let y = TOP;
    for (const lane of lanes) {
      const h = lane.rows * ROW + LANE_PAD * 2;
      root.appendChild(svg("rect", { class: "lane", x: 0, y: y, width: width, height: h - 2 }));
      root.appendChild(svg("text", { class: "lane-label", x: 6, y: y + h / 2 + 4 }, lane.name));
      for (const { a, row } of lane.placed) {
        const by = y + LANE_PAD + row * ROW;
        if (a.queued && a.queued < a.started) {
          root.appendChild(svg("line", { class: "wait", x1: x(a.queued), x2: x(a.started),
                                         y1: by + ROW / 2 - 1, y2: by + ROW / 2 - 1 }));
        }
        const bx = x(a.started), bw = Math.max(2, x(end(a)) - bx);
        const bar = svg("rect", { class: "bar s-" + a.status, "data-id": a.id, "data-status": a.status,
                                  x: bx, y: by + 2, width: bw, height: ROW - 5 });
        bar.appendChild(svg("title", {}, a.id + " · " + (a.name || "") + " · " + a.status + " · " +
                                         fmtDuration(end(a) - a.started)));
        root.appendChild(bar);
        const inside = bw > 8 * Math.min(a.id.length, 18) + 8;  // else just after the bar
        root.appendChild(svg("text", { class: "bar-label",
                                       x: inside ? bx + 4 : bx + bw + 4, y: by + ROW / 2 + 2 },
                             clip(a.id, 18)));
      }
      y += h;
    }
    box.replaceChildren(root);
  }
  function niceStep(raw) {
    const p = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
    return 10 * p;
  }
  function fmtTick(s, step) { return step < 1 ? s.toFixed(step < 0.1 ? 2 : 1) + "s" : Math.round(s) + "s"; }

  // -- start -------------------------------------------------------------------------------
  load();
  connect();
  ticker = setInterval(() => { if (!TERMINAL_JOB.has(job.status)) schedule(); }, 250);
  window.addEventListener("resize", schedule);
})();
