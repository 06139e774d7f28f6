"""Incremental parser for the Streaming Execution Protocol (protocol.md §1–2).

`StreamParser.feed(chunk)` returns the events the chunk completes; `close()` flushes the end
of the stream. Work is constant per character: text is located with `str.find`, and only the
few characters of a candidate tag are ever held back, so nothing is rescanned.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from cortex_worker.protocol.actions import NAME_ALIASES, ActionError, build_action
from cortex_worker.protocol.lenient_json import JSONBodyError, loads

# Parse event types.
TEXT = "text"
THOUGHT_CHUNK = "thought_chunk"
THOUGHT_END = "thought_end"
ACTION_PARSED = "action_parsed"
RESPONSE_CHUNK = "response_chunk"
RESPONSE_END = "response_end"
CONTEXT_FEED = "context_feed"
PROTOCOL_ERROR = "protocol_error"
WARNING = "warning"
CHUNK_TYPES = frozenset({TEXT, THOUGHT_CHUNK, RESPONSE_CHUNK})

MAX_TAG_CHARS = 4096  # an opening tag longer than this is text, not a tag


@dataclass(slots=True)
class ParseEvent:
    """One event of the parse: `type` is one of the constants above."""

    type: str
    data: dict[str, Any] = field(default_factory=dict)


# Contexts: where the parser is.
OUTSIDE, THOUGHT, RESPONSE, ACTION, FEED, RESULT = range(6)
_BLOCK_NAMES = {THOUGHT: "thought", RESPONSE: "response", ACTION: "action",
                FEED: "context_feed", RESULT: "result"}

# The tag names recognised in each context ("/x" closes x).
_TAGS: dict[int, frozenset[str]] = {
    OUTSIDE: frozenset({"thought", "action", "response", "context_feed", "result",
                        "/thought", "/action", "/response"}),
    THOUGHT: frozenset({"action", "/thought", "thought", "response"}),
    RESPONSE: frozenset({"/response"}),
    ACTION: frozenset({"/action"}),
    FEED: frozenset({"/context_feed"}),
    RESULT: frozenset({"/result"}),
}
_PREFIXES = {ctx: frozenset(n[:k] for n in names for k in range(1, len(n) + 1))
             for ctx, names in _TAGS.items()}
_ATTR = re.compile(
    r"""([A-Za-z_][\w\-:.]*)\s*(?:=\s*("[^"]*"|'[^']*'|\[[^\]]*\]|[^\s"'>\[]+))?""")
_ACTION_ATTRS = frozenset({"type", "mode", "id", "depends_on", "timeout", "retry", "output_key",
                           "on_error", *NAME_ALIASES})
_TRUE = {"true", "1", "yes", ""}
_FALSE = {"false", "0", "no"}
_SLUG = re.compile(r"[^A-Za-z0-9_]+")


def parse_attributes(text: str) -> dict[str, str]:
    """Attributes of a tag: `"`, `'` or no quotes; names are lower-cased."""
    attrs: dict[str, str] = {}
    for match in _ATTR.finditer(text):
        value = match.group(2)
        if value is None:
            value = ""
        elif value[0] in "\"'":
            value = value[1:-1]
        attrs[match.group(1).lower()] = value
    return attrs


class StreamParser:
    """Parses a protocol stream chunk by chunk; the events do not depend on the chunking."""

    def __init__(self, *, first_action_number: int = 1, known_ids: set[str] | None = None) -> None:
        self._ctx = OUTSIDE
        self._parent = OUTSIDE  # where an action returns to: OUTSIDE or THOUGHT
        self._events: list[ParseEvent] = []
        self._closed = False
        # candidate tag state
        self._tag: str | None = None  # raw text since '<', or None
        self._tag_name = ""
        self._tag_phase = 0  # 0 name, 1 close (after name), 2 attributes
        self._tag_quote = ""
        self._tag_depth = 0
        self._tag_pos = (1, 1)
        # current block state
        self._buf: list[str] = []  # body of the current block
        self._thought: list[str] = []  # thought text held while an action interrupts it
        self._block_attrs: dict[str, str] = {}
        self._block_pos = (1, 1)
        self._body_pos = (1, 1)
        self._thought_pos = (1, 1)
        self._final = True
        self._tag_end = 0  # offset just past the last closing tag
        # ids
        self._ids: set[str] = set(known_ids or ())
        self._action_number = first_action_number - 1
        # position bookkeeping
        self._offset = 0  # absolute offset of the current chunk
        self._chunk = ""
        self._scan_i = 0
        self._line = 1
        self._line_start = 0

    # -- public API ---------------------------------------------------------------------
    def feed(self, chunk: str) -> list[ParseEvent]:
        """Consume `chunk` and return the events it completes."""
        if self._closed:
            raise RuntimeError("feed() after close()")
        events = self._events = []
        self._chunk, self._scan_i = chunk, 0
        i, n = 0, len(chunk)
        while i < n:
            if self._tag is not None:
                i = self._scan_tag(chunk, i, n)
                continue
            j = chunk.find("<", i)
            if j < 0:
                self._content(chunk[i:] if i else chunk)
                break
            if j > i:
                self._content(chunk[i:j])
            self._tag = "<"
            self._tag_name = ""
            self._tag_phase = 0
            self._tag_pos = self._pos(j)
            i = j + 1
        self._pos(n)
        self._offset += n
        return events

    def close(self) -> list[ParseEvent]:
        """End the stream: flush held text and report blocks left open."""
        if self._closed:
            return []
        events = self._events = []
        self._chunk, self._scan_i = "", 0
        if self._tag is not None:
            if self._tag_phase == 2:
                name = self._tag_name
                self._tag = None
                if not name.startswith("/"):
                    self._error("unclosed_block", f"<{name}> tag is never closed with '>'",
                                self._tag_pos)
            else:
                self._flush_tag()
        if self._ctx == ACTION:
            self._error("unclosed_block", "<action> block is never closed with </action>",
                        self._block_pos)
            self._ctx = self._parent
            self._buf = []
        if self._ctx == THOUGHT:
            self._error("unclosed_block", "<thought> block is never closed with </thought>",
                        self._thought_pos)
            self._end_thought()
        elif self._ctx == RESPONSE:
            self._error("unclosed_block", "<response> block is never closed with </response>",
                        self._block_pos)
            self._end_response()
        elif self._ctx in (FEED, RESULT):
            name = _BLOCK_NAMES[self._ctx]
            self._error("unclosed_block", f"<{name}> block is never closed with </{name}>",
                        self._block_pos)
        self._ctx = OUTSIDE
        self._closed = True
        return events

    # -- positions ----------------------------------------------------------------------
    def _pos(self, i: int) -> tuple[int, int]:
        """Line and column (1-based) of index `i` of the current chunk; `i` only grows."""
        chunk, start = self._chunk, self._scan_i
        if i > start:
            newlines = chunk.count("\n", start, i)
            if newlines:
                self._line += newlines
                self._line_start = self._offset + chunk.rfind("\n", start, i) + 1
            self._scan_i = i
        return self._line, self._offset + i - self._line_start + 1

    # -- events -------------------------------------------------------------------------
    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        self._events.append(ParseEvent(kind, data))

    def _error(self, kind: str, message: str, pos: tuple[int, int], **extra: Any) -> None:
        self._emit(PROTOCOL_ERROR, {"kind": kind, "message": message,
                                    "line": pos[0], "column": pos[1], **extra})

    def _warn(self, kind: str, message: str, pos: tuple[int, int], **extra: Any) -> None:
        self._emit(WARNING, {"kind": kind, "message": message,
                             "line": pos[0], "column": pos[1], **extra})

    def _content(self, text: str) -> None:
        ctx = self._ctx
        if ctx == OUTSIDE:
            self._emit(TEXT, {"text": text})
        elif ctx == THOUGHT:
            self._thought.append(text)
            self._emit(THOUGHT_CHUNK, {"text": text})
        elif ctx == RESPONSE:
            self._buf.append(text)
            self._emit(RESPONSE_CHUNK, {"text": text, "final": self._final})
        else:
            self._buf.append(text)

    # -- tags ---------------------------------------------------------------------------
    def _flush_tag(self) -> None:
        """The held characters were not a tag: they are content."""
        raw, self._tag = self._tag, None
        if raw:
            self._content(raw)

    def _scan_tag(self, chunk: str, i: int, n: int) -> int:
        """Advance the candidate tag over `chunk[i:]`; return the next index to process."""
        raw = self._tag
        assert raw is not None
        if self._tag_phase == 2:
            return self._scan_attributes(chunk, i, n)
        names = _TAGS[self._ctx]
        prefixes = _PREFIXES[self._ctx]
        name = self._tag_name
        while i < n:
            c = chunk[i]
            if self._tag_phase == 1:  # after a closing tag's name: spaces, then '>'
                if c == ">":
                    self._tag = raw + c
                    self._finish_tag(name, "", i)
                    return i + 1
                if not c.isspace():
                    break
            elif name in names and (c in "/>" or c.isspace()):
                if name[0] == "/":
                    self._tag_phase = 1
                    continue
                self._tag_phase = 2
                self._tag_quote, self._tag_depth = "", 0
                self._tag = raw
                return self._scan_attributes(chunk, i, n)
            else:
                candidate = name + c.lower()
                if candidate not in prefixes:
                    break
                name = self._tag_name = candidate
            raw += c
            i += 1
        else:
            self._tag = raw
            return i
        self._tag = raw
        self._flush_tag()  # not a tag; chunk[i] is processed as ordinary input
        return i

    def _scan_attributes(self, chunk: str, i: int, n: int) -> int:
        raw = self._tag
        assert raw is not None
        start = i
        end = min(n, i + MAX_TAG_CHARS - len(raw))  # the limit falls on the same character
        quote, depth = self._tag_quote, self._tag_depth  # whatever the chunking
        while i < end:
            c = chunk[i]
            if quote:
                if c == quote:
                    quote = ""
            elif c in "\"'":
                quote = c
            elif c == "[":
                depth += 1
            elif c == "]" and depth:
                depth -= 1
            elif c == ">" and not depth:
                raw += chunk[start:i + 1]
                self._tag = raw
                attrs = raw[len(self._tag_name) + 1:-1]
                self._finish_tag(self._tag_name, attrs, i)
                return i + 1
            i += 1
        raw += chunk[start:i]
        self._tag, self._tag_quote, self._tag_depth = raw, quote, depth
        if len(raw) >= MAX_TAG_CHARS:
            self._warn("malformed_tag", f"<{self._tag_name} tag runs past {MAX_TAG_CHARS} "
                       "characters without '>'; treated as text", self._tag_pos)
            self._flush_tag()
        return i

    def _finish_tag(self, name: str, attrs: str, end: int) -> None:
        """A whole tag `<name attrs>` ends at index `end` of the current chunk."""
        raw = self._tag or ""
        self._tag = None
        pos = self._tag_pos
        self_closing = attrs.rstrip().endswith("/")
        if self_closing:
            attrs = attrs.rstrip()[:-1]
        ctx = self._ctx
        if name[0] == "/":
            self._tag_end = self._offset + end + 1
            if ctx == OUTSIDE:  # a stray closing tag stays visible as text
                self._content(raw)
                self._warn("stray_tag", f"<{name}> outside any block is kept as text", pos)
            elif ctx == THOUGHT:
                self._end_thought()
            elif ctx == RESPONSE:
                self._end_response()
            elif ctx == ACTION:
                self._end_action()
            elif ctx == FEED:
                self._end_feed()
            else:
                self._ctx = OUTSIDE
                self._buf = []
            return
        if ctx == THOUGHT and name != "action":
            self._warn("unclosed_block", f"<thought> closed by <{name}> without </thought>", pos)
            self._end_thought()
        body_pos = self._pos(end + 1)
        self._block_attrs = parse_attributes(attrs)
        self._block_pos, self._body_pos = pos, body_pos
        self._buf = []
        if name == "thought":
            self._ctx = THOUGHT
            self._thought = []
            self._thought_pos = pos
        elif name == "action":
            self._parent = self._ctx
            self._ctx = ACTION
        elif name == "response":
            self._ctx = RESPONSE
            self._final = self._parse_final(self._block_attrs.get("final"), pos)
        elif name == "context_feed":
            self._ctx = FEED
        elif name == "result":
            self._ctx = RESULT
            self._warn("runtime_block", "<result> blocks are written by the runtime; "
                       "this one is ignored", pos)
        if self_closing:
            self._finish_tag("/" + name, "", end)

    def _parse_final(self, value: str | None, pos: tuple[int, int]) -> bool:
        if value is None:
            return True
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text not in _FALSE:
            self._warn("invalid_attribute", f"final={value!r} is neither true nor false; "
                       "treated as true", pos)
            return True
        return False

    # -- block ends ---------------------------------------------------------------------
    def _end_thought(self) -> None:
        self._emit(THOUGHT_END, {"text": "".join(self._thought)})
        self._thought = []
        self._ctx = OUTSIDE

    def _end_response(self) -> None:
        self._emit(RESPONSE_END, {"text": "".join(self._buf), "final": self._final})
        self._buf = []
        self._ctx = OUTSIDE

    def _end_feed(self) -> None:
        text = "".join(self._buf).strip()
        try:
            value: Any = json.loads(text)
        except (ValueError, RecursionError):
            value = text
        ident = self._block_attrs.get("id", "").strip()
        if ident:
            self._emit(CONTEXT_FEED, {"id": ident, "value": value})
        else:
            self._error("invalid_json", "<context_feed> has no id attribute", self._block_pos)
        self._buf = []
        self._ctx = OUTSIDE

    def _end_action(self) -> None:
        in_thought = self._parent == THOUGHT
        self._ctx = self._parent
        self._action_number += 1
        text, self._buf = "".join(self._buf), []
        pos, attrs = self._block_pos, self._block_attrs
        ident = attrs.get("id")
        body: Any = {}
        if text.strip():
            try:
                body, repairs = loads(text)
            except JSONBodyError as exc:
                line = self._body_pos[0] + exc.line - 1
                column = exc.column + (self._body_pos[1] - 1 if exc.line == 1 else 0)
                self._error("invalid_json", f"action body: {exc.message}", (line, column),
                            action_id=ident)
                return
            for repair in dict.fromkeys(repairs):
                self._warn("repaired_json", f"action body: {repair}", pos, action_id=ident)
        if not isinstance(body, dict):
            self._error("invalid_json", "action body must be a JSON object", pos, action_id=ident)
            return
        try:
            action, warnings = build_action(attrs, body, default_id=self._next_id(attrs, body),
                                            in_thought=in_thought, line=pos[0], column=pos[1])
        except ActionError as exc:
            self._error(exc.kind, exc.message, pos, action_id=body.get("id", ident))
            return
        if action.id in self._ids:
            self._error("duplicate_id", f"action id {action.id!r} is already used in this job; "
                        "give each action its own id", pos, action_id=action.id)
            return
        self._ids.add(action.id)
        for key in sorted(set(attrs) - _ACTION_ATTRS):
            warnings.append(f"ignored unknown attribute {key!r} of <action>")
        for message in warnings:
            self._warn("unknown_field", message, pos, action_id=action.id)
        self._emit(ACTION_PARSED, {"action": action, "end": self._tag_end})

    def _next_id(self, attrs: dict[str, str], body: dict[str, Any]) -> str:
        """A generated id for an action without one: `<name>-<n>`, never a valid `$name`."""
        name = next((str(v) for k in NAME_ALIASES
                     for v in (body.get(k), attrs.get(k)) if v), "action")
        base = _SLUG.sub("_", name).strip("_") or "action"
        number = self._action_number
        while f"{base}-{number}" in self._ids:
            number += 1
        return f"{base}-{number}"


def parse_document(text: str) -> list[ParseEvent]:
    """Parse a whole document at once."""
    parser = StreamParser()
    return parser.feed(text) + parser.close()


def coalesce(events: list[ParseEvent]) -> list[ParseEvent]:
    """Join adjacent text chunks of the same kind: the chunking-invariant view of events."""
    out: list[ParseEvent] = []
    pieces: list[str] = []

    def close_run() -> None:
        if len(pieces) > 1:
            last = out[-1]
            out[-1] = ParseEvent(last.type, {**last.data, "text": "".join(pieces)})
        pieces.clear()

    for event in events:
        if (event.type in CHUNK_TYPES and out and pieces and out[-1].type == event.type
                and out[-1].data.get("final") == event.data.get("final")):
            pieces.append(event.data["text"])
            continue
        close_run()
        out.append(event)
        if event.type in CHUNK_TYPES:
            pieces.append(event.data["text"])
    close_run()
    return out
