// The job page: one GET of the job, then its event log over SSE (replayed from the start, then
// live; EventSource resumes with Last-Event-ID by itself). Every string goes in as text;
// responses are rendered by markdown.js, which builds elements and never parses HTML.
"use strict";
(function () {
  const C = window.Cortex;
  const { el, fmtTime, fmtDuration } = C;
  const $ = (id) => document.getElementById(id);
  const config = JSON.parse($("cx-config").textContent);
  const jobId = config.job_id;
  const dockerTools = new Set(config.docker_tools || []);
  const apiBase = "../v1/jobs/" + encodeURIComponent(jobId);
  const SVG = "http://www.w3.org/2000/svg";
  // The vocabulary (cortex_worker/protocol/events.py) comes with the page, in its config.
  const EVENT_TYPES = config.event_types;  // each is listened for: SSE messages are named by type
  const TERMINAL_JOB = new Set(config.terminal_jobs);
  const TERMINAL_ACTION = new Set(config.terminal_actions);
  const RANK = { pending: 0, waiting: 1, awaiting_approval: 2, queued: 2, running: 3 };
  const JOB_RANK = { loading: -1, queued: 0, running: 1, finishing: 2 };
  const POOLS = ["model", "agent", "tool", "docker", "llm", "relic"];
  const TYPE_POOL = { tool: "tool", llm: "llm", agent: "agent", relic: "relic", workflow: "agent", internal: "agent" };
  const SHOWN_CHARS = 20000;  // of a parameter or result value, in an action's panel

  const job = { status: "loading", kind: null, agent: null, created: null, started: null,
                finished: null, error: null, turns: null };
  const actions = new Map();  // id -> action state, in the order first seen
  const turns = new Map();  // turn -> {start, end (of the model's stream), tokens, estimated}
  let lastSeq = 0;
  let clockOffset = null;  // server seconds - browser seconds (estimated from live events)
  let structureDirty = true;
  let pending = false;
  let source = null;
  let ticker = null;

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  const now = () => Date.now() / 1000 + (clockOffset || 0);

  // -- state -------------------------------------------------------------------------------
  function action(id) {
    let a = actions.get(id);
    if (!a) {
      a = { id: id, type: null, name: null, mode: null, status: "pending", deps: new Set(),
            after: new Set(), queued: null, started: null, finished: null, attempts: 0, error: null,
            params: undefined, substituted: undefined, result: undefined, truncated: false,
            durationMs: null, worker: null, retries: [], approval: null, child: null };
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
  function turn(n) {
    if (!turns.has(n)) turns.set(n, { start: null, end: null, tokens: null, estimated: false });
    return turns.get(n);
  }

  // The job JSON (GET /v1/jobs/{id}): full dependency lists, times, statuses, results.
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
      if (a.result === undefined && v.status === "ok") { a.result = v.result; a.truncated = v.truncated; }
      a.durationMs = a.durationMs ?? v.duration_ms;
    }
    schedule();
  }

  async function load() {
    const answer = await C.api("GET", apiBase);
    if (!isNaN(answer.date) && clockOffset === null) clockOffset = answer.date / 1000 - Date.now() / 1000;
    if (answer.status === 404) { job.error = "This job does not exist (or it expired)."; schedule(); }
    else if (answer.ok) mergeJob(answer.body);
  }

  // -- events ------------------------------------------------------------------------------
  const stream = { open: null };  // the thought or response block being written
  function streamBlock(kind, final) {
    const empty = $("stream-empty");
    if (empty) empty.remove();
    const block = el("div", { class: "block " + kind + (final ? " final" : "") });
    block.appendChild(el("span", { class: "label" }, kind));
    const body = el("div", { class: "text" });
    block.appendChild(body);
    $("stream").appendChild(block);
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
      case "turn_started": job.turns = d.turn; setJobStatus("running");
        turn(d.turn).start = ev.ts;
        follow($("stream"), () => streamNote("turn-mark", "turn " + d.turn));
        break;
      case "usage": { const t = turn(d.turn); t.end = t.end || ev.ts;
        t.tokens = d.completion_tokens ?? null; t.estimated = !!d.estimated; break; }
      case "turn_completed": { const t = turn(d.turn); t.end = t.end || ev.ts; break; }
      case "job_completed": case "job_failed": case "job_cancelled":
        job.status = d.status || ev.type.slice(4);
        job.finished = ev.ts;
        job.error = d.error || d.reason || null;
        for (const t of turns.values()) t.end = t.end || ev.ts;
        end();
        break;
      case "action_parsed": {
        const spec = d.action || {};
        const a = action(spec.id);
        a.type = spec.type; a.name = spec.name; a.mode = spec.mode; a.params = spec.parameters;
        addDeps(a, spec.depends_on, []);
        follow($("stream"), () => streamNote("chip", "action " + spec.id + " · " + spec.type + " " + spec.name));
        break;
      }
      case "approval_requested": { const a = action(d.action_id); setStatus(a, "awaiting_approval");
        a.substituted = d.parameters; a.approval = { requested: ev.ts, expires: d.expires_at, decision: null };
        break; }
      case "action_approved": case "action_rejected": { const a = action(d.action_id);
        a.approval = Object.assign(a.approval || {}, { decision: ev.type.slice(7), by: d.by, reason: d.reason });
        if (ev.type === "action_approved") { setStatus(a, "queued"); a.queued = null; }  // queued again now
        break; }
      case "action_queued": { const a = action(d.action_id); setStatus(a, "queued");
        if (a.queued === null) a.queued = ev.ts; break; }
      case "action_started": { const a = action(d.action_id); setStatus(a, "running");
        if (a.started === null) a.started = ev.ts; a.attempts = d.attempt || a.attempts;
        a.worker = d.worker || a.worker; break; }
      case "action_retrying": { const a = action(d.action_id); setStatus(a, "queued");
        a.retries.push({ attempt: d.attempt, error: d.error }); break; }
      case "action_completed": case "action_failed": { const a = action(d.action_id);
        setStatus(a, d.status || (ev.type === "action_completed" ? "ok" : "error"));
        a.finished = ev.ts; a.error = d.error || null; a.durationMs = d.duration_ms ?? a.durationMs;
        if (ev.type === "action_completed") { a.result = d.result; a.truncated = !!d.truncated; }
        break; }
      case "action_skipped": { const a = action(d.action_id); setStatus(a, "skipped");
        a.error = d.reason || null; break; }
      case "action_cancelled": { const a = action(d.action_id); setStatus(a, "cancelled");
        a.finished = a.started ? ev.ts : a.finished; break; }
      case "child_job": action(d.action_id).child = d.job_id; break;
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
        block.body.replaceChildren(window.CortexMarkdown.render(d.text || ""));
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

  function connect() {
    source = new EventSource(C.withKey(apiBase + "/events"));
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

  // -- cancel and approve (the API answers; the events then change the page) -------------
  let armed = null;  // cancelling takes a second click within a few seconds
  async function onCancel() {
    const button = $("cancel");
    if (!armed) {
      button.textContent = "Click again to cancel";
      button.classList.add("armed");
      armed = setTimeout(() => { armed = null; button.textContent = "Cancel job"; button.classList.remove("armed"); }, 4000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    button.disabled = true;
    button.textContent = "Cancelling…";
    const answer = await C.api("POST", apiBase + "/cancel");
    if (!answer.ok) {
      $("cancel-error").hidden = false;
      $("cancel-error").textContent = C.message(answer);
      button.disabled = false;
      button.classList.remove("armed");
      button.textContent = "Cancel job";
    }
  }

  async function decide(a, verdict, box) {
    const reason = box.querySelector("input").value.trim();
    const error = box.querySelector(".error");
    for (const b of box.querySelectorAll("button")) b.disabled = true;
    error.hidden = true;
    const answer = await C.api("POST", apiBase + "/actions/" + encodeURIComponent(a.id) + "/" + verdict,
                               { reason: reason || null });
    if (answer.ok) {
      box.querySelector(".state").textContent = verdict === "approve" ? "Approved: waiting for it to start…" : "Rejected.";
      return;
    }
    error.hidden = false;
    error.textContent = C.message(answer);
    for (const b of box.querySelectorAll("button")) b.disabled = false;
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
    renderCards();
  }

  function renderHeader() {
    const badge = $("job-status");
    badge.textContent = job.status;
    badge.setAttribute("data-status", job.status);
    document.title = "Cortex · " + job.status + " · job " + jobId;
    $("cancel").hidden = job.status === "loading" || TERMINAL_JOB.has(job.status);
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
      Object.entries(counts).map(([s, n]) => n + " " + s.replace("_", " ")).join(", ") + ")" : "";
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
      g.appendChild(svg("text", { class: "name", x: 8, y: 30 }, clip((a.name || "") + " · " + a.status.replace("_", " "), 24)));
      g.addEventListener("click", () => showCard(a.id));
      root.appendChild(g);
    }
    $("dag").replaceChildren(root, legend());
  }
  function clip(text, n) { text = String(text); return text.length > n ? text.slice(0, n - 1) + "…" : text; }
  function legend() {
    const box = el("div", { class: "legend" });
    for (const s of ["pending", "awaiting_approval", "queued", "running", "ok", "error", "timeout", "skipped", "cancelled"]) {
      const item = el("span");
      item.appendChild(el("i", { style: "background: var(--" + s + ")" }));
      item.appendChild(document.createTextNode(s.replace("_", " ")));
      box.appendChild(item);
    }
    return box;
  }

  // Gantt: the model's generation (a bar per turn, from its start to the end of the model's
  // stream), then a lane per pool; overlapping bars of a lane go on separate rows.
  function renderGantt() {
    const t = now();
    const live = !TERMINAL_JOB.has(job.status);
    const items = [];
    for (const [n, tr] of turns) {
      if (tr.start === null) continue;
      const tokens = tr.tokens === null ? "" : " · " + (tr.estimated ? "~" : "") + tr.tokens + " tokens";
      const stop = tr.end || (live ? t : job.finished || tr.start);
      items.push({ id: "turn " + n, lane: "model", from: tr.start, start: tr.start, end: stop,
                   cls: "bar model" + (tr.end ? "" : " s-running"), status: tr.end ? "done" : "running",
                   title: "turn " + n + " · the model wrote for " + fmtDuration(stop - tr.start) + tokens });
    }
    for (const a of actions.values()) {
      if (!a.started) continue;
      const stop = a.finished || (TERMINAL_ACTION.has(a.status) ? a.started : (job.finished || t));
      const waited = (a.approval && a.approval.requested) || a.queued;  // for a person, or a worker
      items.push({ id: a.id, lane: pool(a), from: Math.min(waited || a.started, a.started),
                   queued: waited, start: a.started, end: stop, cls: "bar s-" + a.status, status: a.status,
                   title: a.id + " · " + (a.name || "") + " · " + a.status + " · " + fmtDuration(stop - a.started) });
    }
    if (!items.length) return;
    let t0 = Math.min(...items.map((i) => i.from));
    if (job.started && job.started < t0) t0 = job.started;
    let t1 = Math.max(...items.map((i) => i.end), job.finished || (live ? t : 0));
    if (t1 - t0 < 0.5) t1 = t0 + 0.5;
    const lanes = [];
    for (const name of POOLS) {
      const mine = items.filter((i) => i.lane === name).sort((a, b) => a.from - b.from);
      if (!mine.length) continue;
      const rowEnds = [];
      const placed = mine.map((item) => {
        let r = rowEnds.findIndex((e) => e <= item.from);
        if (r < 0) { r = rowEnds.length; rowEnds.push(0); }
        rowEnds[r] = item.end;
        return { item: item, row: r };
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
      root.appendChild(svg("rect", { class: "lane" + (lane.name === "model" ? " model-lane" : ""),
                                     x: 0, y: y, width: width, height: h - 2 }));
      root.appendChild(svg("text", { class: "lane-label", x: 6, y: y + h / 2 + 4 }, lane.name));
      for (const { item, row } of lane.placed) {
        const by = y + LANE_PAD + row * ROW;
        if (item.queued && item.queued < item.start) {
          root.appendChild(svg("line", { class: "wait", x1: x(item.queued), x2: x(item.start),
                                         y1: by + ROW / 2 - 1, y2: by + ROW / 2 - 1 }));
        }
        const bx = x(item.start), bw = Math.max(2, x(item.end) - bx);
        const bar = svg("rect", { class: item.cls, "data-id": item.id, "data-status": item.status,
                                  x: bx, y: by + 2, width: bw, height: ROW - 5 });
        bar.appendChild(svg("title", {}, item.title));
        root.appendChild(bar);
        const inside = bw > 8 * Math.min(item.id.length, 18) + 8;  // else just after the bar
        root.appendChild(svg("text", { class: "bar-label" + (inside && lane.name === "model" ? " on-model" : ""),
                                       x: inside ? bx + 4 : bx + bw + 4, y: by + ROW / 2 + 2 },
                             clip(item.id, 18)));
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

  // Action panels: built once per action and updated in place (a reason being typed, or a
  // panel the reader closed, stays as it is), and only when what they show has changed.
  const cards = new Map();  // action id -> {root, summary, body, approval, head, shown}
  function showCard(id) {
    const card = cards.get(id);
    if (!card) return;
    card.root.open = true;
    card.root.scrollIntoView({ behavior: "smooth", block: "center" });
  }
  function valueText(value) {
    const line = JSON.stringify(value);
    const text = typeof value === "string" ? value : line.length <= 80 ? line : JSON.stringify(value, null, 2);
    return text.length > SHOWN_CHARS ? text.slice(0, SHOWN_CHARS) + "\n… (" + text.length + " characters)" : text;
  }
  function renderCards() {
    if (!actions.size) return;
    const empty = $("cards-empty");
    if (empty) empty.remove();
    for (const a of actions.values()) {
      let card = cards.get(a.id);
      if (!card) {
        const root = el("details", { class: "card", open: "", "data-id": a.id });
        const summary = root.appendChild(el("summary"));
        card = { root: root, summary: summary, body: root.appendChild(el("div", { class: "card-body" })),
                 approval: null, head: null, shown: null };
        cards.set(a.id, card);
        $("cards").appendChild(root);
      }
      updateCard(a, card);
    }
  }
  function updateCard(a, card) {
    const running = a.status === "running" && a.started ? Math.floor((now() - a.started) * 10) : null;
    const head = JSON.stringify([a.status, a.type, a.name, a.mode, a.attempts, a.durationMs,
                                 a.started, a.finished, running, a.approval]);
    if (head !== card.head) { card.head = head; updateSummary(a, card); }
    const shown = JSON.stringify([a.status, a.queued, a.started, a.finished, a.worker, [...a.deps],
      a.error, a.result, a.params, a.substituted, a.approval, a.retries, a.child, job.started]);
    if (shown !== card.shown) { card.shown = shown; updateBody(a, card); }
  }
  function updateSummary(a, card) {
    card.root.setAttribute("data-status", a.status);
    const s = card.summary;
    s.replaceChildren(el("code", { class: "card-id" }, a.id),
                      el("span", { class: "chip" }, (a.type || "?") + " " + (a.name || "")),
                      el("span", { class: "badge small", "data-status": a.status }, a.status.replace("_", " ")));
    const took = a.durationMs !== null && a.durationMs !== undefined ? a.durationMs / 1000
      : a.started ? (a.finished || (TERMINAL_ACTION.has(a.status) ? a.started : now())) - a.started : null;
    const facts = [a.mode, a.attempts ? a.attempts + (a.attempts === 1 ? " attempt" : " attempts") : null,
                   took !== null ? fmtDuration(took) + (a.status === "running" ? "…" : "") : null].filter(Boolean);
    s.appendChild(el("span", { class: "muted facts" }, facts.join(" · ")));

    // The box waits for `approval_requested` (it brings the parameters to approve): the
    // job's view, loaded beside the stream, may say "awaiting approval" before it arrives.
    if (a.status === "awaiting_approval" && a.approval && !card.approval) {
      card.approval = approvalBox(a);
      card.root.insertBefore(card.approval, card.body);
    } else if (a.status !== "awaiting_approval" && card.approval) {
      card.approval.remove();
      card.approval = null;
    }
    if (card.approval && a.approval && a.approval.expires) {
      card.approval.querySelector(".expires").textContent = "expires " + fmtTime(a.approval.expires);
    }
  }
  function updateBody(a, card) {
    const body = [];
    const since = (ts) => (ts && job.started ? fmtTime(ts) + " (+" + fmtDuration(ts - job.started) + ")" : fmtTime(ts));
    const times = el("dl", { class: "times" });
    const rows = [["approval requested", a.approval && since(a.approval.requested)],
                  ["queued", a.queued && since(a.queued)], ["started", a.started && since(a.started)],
                  ["finished", a.finished && since(a.finished)], ["worker", a.worker],
                  ["depends on", [...a.deps].join(", ")]];
    if (a.approval && a.approval.decision) {
      rows.push([a.approval.decision, "by " + a.approval.by + (a.approval.reason ? ": " + a.approval.reason : "")]);
    }
    for (const [k, v] of rows) {
      if (!v) continue;
      const row = times.appendChild(el("div"));
      row.appendChild(el("dt", {}, k));
      row.appendChild(el("dd", { "data-field": k }, v));
    }
    if (times.childNodes.length) body.push(times);
    if (a.child) {
      body.push(el("a", { class: "child", href: C.withKey("./" + encodeURIComponent(a.child)) }, "its child job " + a.child + " →"));
    }
    const params = a.substituted !== undefined ? a.substituted : a.params;
    if (params !== undefined) {
      body.push(el("h3", {}, "parameters"));
      if (a.substituted !== undefined) body.push(el("span", { class: "muted note-inline" }, "after substitution"));
      else if (JSON.stringify(params).includes("$")) {
        body.push(el("span", { class: "muted note-inline" }, "as written: references are substituted when it runs"));
      }
      body.push(el("pre", { class: "value params" }, valueText(params)));
    }
    for (const r of a.retries) {
      body.push(el("p", { class: "retry" }, "attempt " + r.attempt + " failed: " + (r.error || "?")));
    }
    if (a.status === "ok" && a.result !== undefined) {
      body.push(el("h3", {}, "result" + (a.truncated ? " (truncated)" : "")));
      body.push(el("pre", { class: "value result" }, valueText(a.result)));
    } else if (a.error) {
      body.push(el("h3", {}, a.status === "skipped" ? "skipped" : "error"));
      body.push(el("pre", { class: "value error-value" }, a.error));
    }
    card.body.replaceChildren(...body);
  }
  function approvalBox(a) {
    const box = el("div", { class: "approval" });
    box.appendChild(el("strong", { class: "state" }, "Waiting for your approval"));
    box.appendChild(el("span", { class: "muted expires" }));
    const reason = el("input", { type: "text", maxlength: "2000", "aria-label": "reason",
                                 placeholder: "reason (optional): the model reads it if you reject" });
    box.appendChild(reason);
    const approve = el("button", { type: "button", class: "approve" }, "Approve");
    const reject = el("button", { type: "button", class: "reject danger" }, "Reject");
    approve.addEventListener("click", () => decide(a, "approve", box));
    reject.addEventListener("click", () => decide(a, "reject", box));
    box.append(approve, reject, el("span", { class: "error", hidden: "" }));
    return box;
  }

  // -- start -------------------------------------------------------------------------------
  $("home").href = C.withKey("../jobs");
  $("cancel").addEventListener("click", onCancel);
  load();
  connect();
  ticker = setInterval(() => { if (!TERMINAL_JOB.has(job.status)) schedule(); }, 250);
  window.addEventListener("resize", schedule);
})();
