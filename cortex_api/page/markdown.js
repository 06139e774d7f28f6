// Markdown to DOM, for model responses. Safe by construction: every node is made with
// createElement and every string goes in as text, so raw HTML in a response (a <script>, an
// onerror= attribute) shows as the characters it is; a link keeps its target only if it is
// http(s), mailto or relative (no javascript:, data:, vbscript:); images become links (the
// page loads nothing a response names). Covers what models write: headings, paragraphs,
// lists (nested), block quotes, fenced code, tables, rules, emphasis, code spans, links.
"use strict";
window.CortexMarkdown = (function () {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(\s+|$)/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const SCHEME = /^([a-z][a-z0-9+.-]*):/i;

  function node(tag, attrs, text) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  }

  // A link target, or null to drop it. Browsers ignore C0 controls and spaces when they read
  // a scheme ("java\tscript:"), so the check does too.
  function safeHref(url) {
    const compact = url.replace(/[\u0000-\u0020\u007f]/g, "");
    const scheme = SCHEME.exec(compact);
    if (!scheme) return compact ? url.trim() : null;
    return ["http", "https", "mailto"].includes(scheme[1].toLowerCase()) ? url.trim() : null;
  }
  function link(label, url, title) {
    const href = safeHref(url);
    if (href === null) return null;
    const a = node("a", { href: href, rel: "noopener noreferrer nofollow", target: "_blank" });
    if (title) a.title = title;
    inline(label, a, true);
    return a;
  }

  // -- inline ------------------------------------------------------------------------------
  const LINK = /^(!?)\[((?:\\.|[^\]\\])*)\]\(\s*<?([^\s)>]*)>?(?:\s+"([^"]*)")?\s*\)/;
  const AUTOLINK = /^<((?:https?:\/\/|mailto:)[^\s<>]+)>/i;
  const BARE_URL = /^https?:\/\/[^\s<]*[^\s<.,;:!?"')\]]/i;
  const ESCAPABLE = /^\\([!-\/:-@\[-`{-~])/;

  // `inLink`: the label of a link, where no other link may start.
  function inline(text, parent, inLink) {
    let plain = "";
    const flush = () => { if (plain) { parent.appendChild(document.createTextNode(plain)); plain = ""; } };
    let i = 0;
    while (i < text.length) {
      const rest = text.slice(i);
      const ch = text[i];
      let m;
      if (ch === "\\" && (m = ESCAPABLE.exec(rest))) { plain += m[1]; i += 2; continue; }
      if (ch === "\\" && rest[1] === "\n") { flush(); parent.appendChild(node("br")); i += 2; continue; }
      if (ch === "`") {
        const run = /^`+/.exec(rest)[0];
        const end = text.indexOf(run, i + run.length);
        if (end > 0) {
          flush();
          const code = text.slice(i + run.length, end).replace(/\n/g, " ");
          parent.appendChild(node("code", {}, code.length > 2 && code.startsWith(" ") && code.endsWith(" ")
            ? code.slice(1, -1) : code));
          i = end + run.length;
          continue;
        }
        plain += run; i += run.length; continue;
      }
      if (!inLink && (ch === "[" || (ch === "!" && rest[1] === "[")) && (m = LINK.exec(rest))) {
        const made = link(m[1] ? (m[2] || m[3]) : m[2], m[3], m[4]);
        flush();
        if (made) parent.appendChild(made); else inline(m[2], parent, true);
        i += m[0].length;
        continue;
      }
      if (!inLink && ch === "<" && (m = AUTOLINK.exec(rest))) {
        flush(); parent.appendChild(link(m[1], m[1])); i += m[0].length; continue;
      }
      if (!inLink && (ch === "h" || ch === "H") && /\W$|^$/.test(text.slice(Math.max(0, i - 1), i))
          && (m = BARE_URL.exec(rest))) {
        flush(); parent.appendChild(link(m[0], m[0])); i += m[0].length; continue;
      }
      if (ch === "*" || ch === "_" || ch === "~") {
        const made = emphasis(text, i, inLink);
        if (made) { flush(); parent.appendChild(made.node); i = made.end; continue; }
      }
      if (ch === " " && /^ {2,}\n/.test(rest)) { flush(); parent.appendChild(node("br")); i = text.indexOf("\n", i) + 1; continue; }
      plain += ch; i += 1;
    }
    flush();
    return parent;
  }

  // **strong**, __strong__, *em*, _em_, ***both***, ~~strike~~: the delimiter must touch its
  // text on both sides; `_` inside a word (snake_case) is not emphasis.
  function emphasis(text, i, inLink) {
    const ch = text[i];
    if (ch !== "~" && text.startsWith(ch + ch + ch, i)) {
      const end = text.indexOf(ch + ch + ch, i + 3);
      if (end > i + 3 && !/\s/.test(text[i + 3]) && !/\s/.test(text[end - 1])) {
        const em = node("em");
        em.appendChild(inline(text.slice(i + 3, end), node("strong"), inLink));
        return { node: em, end: end + 3 };
      }
    }
    const double = text[i + 1] === ch;
    if (ch === "~" && !double) return null;
    const delim = double ? ch + ch : ch;
    const start = i + delim.length;
    if (start >= text.length || /\s/.test(text[start])) return null;
    if (ch === "_" && i > 0 && /\w/.test(text[i - 1])) return null;
    let end = start;
    while ((end = text.indexOf(delim, end + 1)) !== -1) {
      if (double === false && text[end + 1] === ch) { end += 1; continue; }  // a ** inside *…*
      if (/\s/.test(text[end - 1])) continue;
      if (ch === "_" && /\w/.test(text[end + delim.length] || "")) continue;
      const tag = ch === "~" ? "del" : double ? "strong" : "em";
      return { node: inline(text.slice(start, end), node(tag), inLink), end: end + delim.length };
    }
    return null;
  }

  // -- blocks ------------------------------------------------------------------------------
  const blank = (line) => !line.trim();
  const indent = (line) => /^ */.exec(line)[0].length;
  function startsBlock(line, next) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-"));
  }
  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (blank(line)) { i += 1; continue; }
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i += 1;
        while (i < lines.length && !new RegExp("^ {0,3}" + fence[0] + "{" + fence.length + ",}\\s*$").test(lines[i])) {
          body.push(lines[i]); i += 1;
        }
        i += 1;
        const pre = node("pre");
        const code = node("code", m[2] ? { "data-lang": m[2] } : {}, body.join("\n"));
        pre.appendChild(code);
        parent.appendChild(pre);
        continue;
      }
      if ((m = HEADING.exec(line))) {
        parent.appendChild(inline(m[2] || "", node("h" + m[1].length)));
        i += 1; continue;
      }
      if (RULE.test(line)) { parent.appendChild(node("hr")); i += 1; continue; }
      if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && !blank(lines[i]) && (QUOTE.test(lines[i]) || body.length)) {
          body.push(lines[i].replace(QUOTE, "")); i += 1;
        }
        parent.appendChild(blocks(body, node("blockquote")));
        continue;
      }
      if ((m = ITEM.exec(line))) { i = list(lines, i, parent); continue; }
      if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        const table = node("table");
        const head = node("tr");
        for (const c of cells(line)) head.appendChild(inline(c, node("th")));
        table.appendChild(node("thead")).appendChild(head);
        const body = table.appendChild(node("tbody"));
        i += 2;
        while (i < lines.length && !blank(lines[i]) && lines[i].includes("|")) {
          const row = body.appendChild(node("tr"));
          for (const c of cells(lines[i])) row.appendChild(inline(c, node("td")));
          i += 1;
        }
        const wrap = node("div", { class: "md-table" });
        wrap.appendChild(table);
        parent.appendChild(wrap);
        continue;
      }
      const para = [line.trimStart()];  // trailing spaces stay: two of them break the line
      i += 1;
      while (i < lines.length && !blank(lines[i]) && !startsBlock(lines[i], lines[i + 1])) {
        para.push(lines[i].trimStart()); i += 1;
      }
      parent.appendChild(inline(para.join("\n"), node("p")));
    }
    return parent;
  }

  // A list from lines[i]: items of the same kind at the same indent; an item's other lines
  // are those indented past its marker (and blank lines between them). Returns the next line.
  function list(lines, i, parent) {
    const first = ITEM.exec(lines[i]);
    const ordered = /\d/.test(first[2]);
    const base = first[1].length;
    const box = node(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) box.setAttribute("start", String(parseInt(first[2], 10)));
    let loose = false;
    const items = [];
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length >= base + 2 || /\d/.test(m[2]) !== ordered) break;
      const width = m[0].length || m[1].length + m[2].length + 1;
      const body = [lines[i].slice(m[0].length)];
      i += 1;
      while (i < lines.length) {
        const line = lines[i];
        if (blank(line)) {
          const next = lines.slice(i + 1).find((l) => !blank(l));
          if (next === undefined || indent(next) < width) break;
          body.push(""); loose = true; i += 1; continue;
        }
        if (indent(line) >= Math.min(width, base + 2)) { body.push(line.slice(Math.min(width, indent(line)))); i += 1; continue; }
        if (ITEM.test(line) || startsBlock(line, lines[i + 1])) break;
        body.push(line.trim()); i += 1;  // a lazy continuation of the item's paragraph
      }
      items.push(body);
      const next = lines.slice(i).findIndex((l) => !blank(l));
      if (next > 0) {
        const m2 = ITEM.exec(lines[i + next]);
        if (m2 && m2[1].length < base + 2 && /\d/.test(m2[2]) === ordered) { loose = true; i += next; }
      }
    }
    for (const body of items) {
      const li = box.appendChild(node("li"));
      blocks(body, li);
      if (!loose && li.firstChild && li.firstChild.tagName === "P") {  // a tight list: no <p>
        const p = li.firstChild;
        while (p.firstChild) li.insertBefore(p.firstChild, p);
        p.remove();
      }
    }
    parent.appendChild(box);
    return i;
  }

  /** The rendered Markdown: a fragment of elements and text nodes, nothing else. */
  function render(source) {
    const lines = String(source || "").replace(/\r\n?/g, "\n").replace(/\t/g, "    ").split("\n");
    return blocks(lines, document.createDocumentFragment());
  }

  return { render: render, safeHref: safeHref };
})();
