// What the job page and the jobs dashboard share: the API key, calls to the API, DOM helpers
// that only ever set text, and the formats of times and durations.
"use strict";
window.Cortex = (function () {
  // With API keys configured a page is opened as …?api_key=<key>: the key goes to the API
  // as a header, to an EventSource (which sets no headers) and to the links between pages
  // in the query.
  const apiKey = new URLSearchParams(window.location.search).get("api_key");
  const keyHeaders = apiKey ? { "X-API-Key": apiKey } : {};

  /** `url` with the page's key in its query, if there is one. */
  function withKey(url) {
    if (!apiKey) return url;
    return url + (url.includes("?") ? "&" : "?") + "api_key=" + encodeURIComponent(apiKey);
  }

  /** A call to the API: resolves to {ok, status, body, date}; the body is JSON or null.
   *  Never rejects (a network error is status 0), so callers show what went wrong. */
  async function api(method, url, body) {
    const headers = Object.assign({ Accept: "application/json" }, keyHeaders);
    const init = { method: method, headers: headers };
    if (body !== undefined) { headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
    try {
      const response = await fetch(url, init);
      let json = null;
      try { json = await response.json(); } catch (err) { json = null; }
      return { ok: response.ok, status: response.status, body: json,
               date: Date.parse(response.headers.get("Date") || "") };
    } catch (err) {
      return { ok: false, status: 0, body: null, date: NaN };
    }
  }

  /** The API's message in an error answer (`{"detail": {"message": …}}`), or a status line. */
  function message(answer) {
    const detail = answer.body && answer.body.detail;
    if (detail && typeof detail.message === "string") return detail.message;
    if (typeof detail === "string") return detail;
    return answer.status ? "HTTP " + answer.status : "the API cannot be reached";
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function fmtTime(t) {
    if (!t) return "–";
    const d = new Date(t * 1000);
    const today = new Date().toDateString() === d.toDateString();
    return today ? d.toLocaleTimeString() : d.toLocaleString();
  }
  function fmtDuration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
    if (s < 7200) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
  }

  const TERMINAL_JOB = new Set(["completed", "failed", "cancelled"]);
  const ACTION_STATUSES = ["pending", "waiting", "awaiting_approval", "queued", "running", "ok",
                           "error", "timeout", "skipped", "cancelled"];

  return { apiKey: apiKey, withKey: withKey, api: api, message: message, el: el,
           fmtTime: fmtTime, fmtDuration: fmtDuration, TERMINAL_JOB: TERMINAL_JOB,
           ACTION_STATUSES: ACTION_STATUSES };
})();
