"""What a model stream yields, shared by the gateway, the replay provider and the coordinator.

A stream is an iterator of `Piece`s: `TextDelta` (protocol text as it arrives), `ToolCall` (a
complete native function call, yielded once its fragments are assembled) and `Usage` (token
counts, last). Failures are `ModelError`s.

Native tool calls join the protocol through `tool_call_to_protocol`: the call becomes an
`<action type="tool" mode="async">` block that the coordinator feeds to the same parser as the
model's text, so native and textual actions are planned, dispatched and reported alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cortex_worker.errors import ActionFailed
from cortex_worker.protocol.lenient_json import JSONBodyError, loads

__all__ = [
    "ModelError",
    "Piece",
    "TextDelta",
    "ToolCall",
    "Usage",
    "estimate_usage",
    "protocol_id",
    "tool_call_to_protocol",
]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the model's text (protocol text: thoughts, actions, responses)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete native tool call.

    `arguments` is the decoded JSON object, or None when the model's arguments were not a JSON
    object; `raw_arguments` holds the text exactly as the model wrote it (up to the end of the
    object, for a call handed out when its object closed), so an invalid call can be reported
    (see `tool_call_to_protocol`) instead of being dropped.
    """

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str = ""

    @classmethod
    def from_raw(cls, id: str, name: str, raw_arguments: str) -> ToolCall:
        """Decode `raw_arguments`; empty text means no arguments (`{}`), as OpenAI sends it."""
        if not raw_arguments.strip():
            return cls(id, name, {}, raw_arguments)
        try:
            value = json.loads(raw_arguments)
        except (ValueError, RecursionError):
            value = None
        return cls(id, name, value if isinstance(value, dict) else None, raw_arguments)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one generation, as reported by the endpoint (or estimated by replay)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


Piece = TextDelta | ToolCall | Usage


def estimate_usage(messages: list[dict[str, Any]], deltas: int) -> Usage:
    """Token counts of a generation cut short (the endpoint sent none): about 4 characters
    per prompt token, one token per streamed delta (what OpenAI-compatible endpoints send)."""
    prompt = sum(len(str(m.get("content") or "")) for m in messages) // 4
    return Usage(prompt_tokens=prompt, completion_tokens=deltas, total_tokens=prompt + deltas)


class ModelError(ActionFailed):
    """A model call failed.

    `retryable`: trying again may succeed (connection errors, timeouts, 429, 5xx, a dropped
    stream); `status`: the HTTP status, when there was one; `streamed`: characters of text
    already yielded to the caller before the failure (0: nothing was seen, a retry is clean);
    `attempts`: requests made, the gateway's retries included.
    """

    def __init__(self, message: str, *, retryable: bool = False, status: int | None = None,
                 streamed: int = 0, attempts: int = 1) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.streamed = streamed
        self.attempts = attempts

    def __repr__(self) -> str:
        return (f"ModelError({self.message!r}, retryable={self.retryable}, "
                f"status={self.status}, streamed={self.streamed})")


_NOT_ID = re.compile(r"[^A-Za-z0-9_]+")


def protocol_id(call_id: str) -> str:
    """The action id for a native call id: letters, digits and `_` only, so `$id` works.

    `call_Ab-3.x` → `call_Ab_3_x`; an id starting with a digit gets a `call_` prefix; an empty
    result stays empty (the parser then generates an id).
    """
    ident = _NOT_ID.sub("_", call_id).strip("_")
    if ident and ident[0].isdigit():
        ident = f"call_{ident}"
    return ident


def _no_close_tag(json_text: str) -> str:
    """Make `</` unable to end the `<action>` block early.

    In valid JSON `<` occurs only inside strings, where `<\\/` decodes to the same `</`; in
    invalid JSON the change is harmless (it stays invalid).
    """
    return json_text.replace("</", "<\\/")


def _smuggles(raw: str, name: str) -> bool:
    """Whether invalid `raw` arguments would turn the action body into a different valid one."""
    try:
        body, _ = loads(f'{{"name": {json.dumps(name)}, "parameters": {raw}}}')
    except JSONBodyError:
        return False
    return not (isinstance(body, dict) and set(body) == {"name", "parameters"}
                and body["name"] == name)


def tool_call_to_protocol(call: ToolCall, *, mode: str = "async") -> str:
    """The protocol text of a native tool call: one `<action type="tool">` block.

    Valid arguments become `"parameters"`. Invalid arguments (not a JSON object) are written
    into the body verbatim as the value of `"parameters"`, so the parser reports the problem
    exactly as for a textual action: `invalid_json` with line and column (or "'parameters' must
    be a JSON object"), fed back to the model like any other protocol error. Comments and
    trailing commas are repaired by the parser, as in textual actions. Raw text that would
    close the object early and smuggle in keys of its own (`{...}, "name": "x"`) is written as a
    JSON string instead, which the parser rejects with "'parameters' must be a JSON object".
    """
    ident = protocol_id(call.id)
    id_attr = f' id="{ident}"' if ident else ""
    name = json.dumps(call.name, ensure_ascii=False)
    if call.arguments is not None:
        parameters = json.dumps(call.arguments, ensure_ascii=False)
    else:
        parameters = call.raw_arguments.strip() or "{}"
        if _smuggles(parameters, call.name):
            # The raw text would close the object and add keys of its own: keep it a string.
            parameters = json.dumps(call.raw_arguments, ensure_ascii=False)
    body = _no_close_tag(f'{{"name": {name}, "parameters": {parameters}}}')
    return f'<action type="tool" mode="{mode}"{id_attr}>{body}</action>'
