"""JSON for action bodies: strict, except that comments and trailing commas are repaired."""

from __future__ import annotations

import json
from typing import Any

from cortex_worker.errors import CortexError


class JSONBodyError(CortexError, ValueError):
    """Invalid JSON; `line` and `column` are 1-based and relative to the parsed text."""

    def __init__(self, message: str, line: int = 1, column: int = 1) -> None:
        super().__init__(message)
        self.line = line
        self.column = column


def loads(text: str) -> tuple[Any, list[str]]:
    """Parse `text`; return the value and a list of the repairs made (empty when it was valid)."""
    try:
        return _strict(text), []
    except json.JSONDecodeError as first:
        repaired, repairs = _repair(text)
        if not repairs:
            raise JSONBodyError(f"invalid JSON: {first.msg}", first.lineno, first.colno) from None
        try:
            return _strict(repaired), repairs
        except json.JSONDecodeError as exc:
            raise JSONBodyError(f"invalid JSON: {exc.msg}", exc.lineno, exc.colno) from None


def _strict(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONBodyError("invalid JSON: nested too deeply") from None


def _repair(text: str) -> tuple[str, list[str]]:
    """Blank out comments and trailing commas outside strings; positions are preserved."""
    out = list(text)
    repairs: list[str] = []
    pending_comma = -1  # index of a comma that is trailing if a closer comes next
    last = ""  # the last significant character outside strings and comments
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            pending_comma = -1
            last = c
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        if c == "/" and i + 1 < n and text[i + 1] in "/*":
            end = text.find("\n", i) if text[i + 1] == "/" else text.find("*/", i + 2)
            if end < 0 and text[i + 1] == "*":
                return text, []  # an unterminated /* is not repaired
            end = n if end < 0 else (end if text[i + 1] == "/" else end + 2)
            for k in range(i, end):
                if out[k] != "\n":
                    out[k] = " "
            repairs.append("removed a comment")
            i = end
            continue
        if c == ",":
            pending_comma = i if last not in ("", "[", "{", ",") else -1
            last = c
        elif c in "}]":
            last = c
            if pending_comma >= 0:
                out[pending_comma] = " "
                repairs.append("removed a trailing comma")
            pending_comma = -1
        elif not c.isspace():
            pending_comma = -1
            last = c
        i += 1
    return "".join(out), repairs
