"""Checks of AG-UI event streams, shared by the unit and integration tests of `?format=ag-ui`.

Shapes are checked by the `ag-ui-protocol` package itself (its discriminated `Event` union
parses each event's JSON); its models keep unknown fields, so a misspelt optional key would
pass unnoticed: `parse` also refuses any field the model does not declare. Order is checked
by `assert_well_formed`, the rules of AG-UI's own client-side verifier plus pairing at the end.
"""

from __future__ import annotations

import json
from typing import Any

from ag_ui.core import BaseEvent, Event
from pydantic import BaseModel, TypeAdapter

EVENTS: TypeAdapter[Any] = TypeAdapter(Event)
TERMINAL = ("RUN_FINISHED", "RUN_ERROR")


def parse(text: str) -> BaseEvent:
    """One AG-UI event from its JSON, through the package's union; no undeclared field."""
    event = EVENTS.validate_json(text)
    _no_extra(event, event.type.value)
    return event


def _no_extra(value: Any, where: str) -> None:
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{where}: fields AG-UI does not define: {value.model_extra}"
        for name in type(value).model_fields:
            if name != "raw_event":  # any JSON, by definition
                _no_extra(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for item in value:
            _no_extra(item, where)


def parse_all(events: list[dict[str, Any]]) -> list[BaseEvent]:
    return [parse(json.dumps(event)) for event in events]


def assert_well_formed(events: list[dict[str, Any]]) -> None:
    """RUN_STARTED first; every START has its END, content and args only inside theirs, a
    result only for an ended call, steps paired; RUN_FINISHED or RUN_ERROR last, with
    nothing left open."""
    assert events and events[0]["type"] == "RUN_STARTED", events[:1]
    text: set[str] = set()
    reasoning: set[str] = set()
    spans: set[str] = set()
    calls: set[str] = set()
    ended: set[str] = set()
    steps: set[str] = set()

    def opened(where: set[str], key: str) -> None:
        assert key not in where, f"{key} opened twice"
        where.add(key)

    def closed(where: set[str], key: str) -> None:
        assert key in where, f"{key} closed but not open"
        where.remove(key)

    def inside(where: set[str], key: str) -> None:
        assert key in where, f"{key} is not open"

    for index, event in enumerate(events):
        kind = event["type"]
        message = event.get("messageId", "")
        call = event.get("toolCallId", "")
        if kind in TERMINAL:
            assert index == len(events) - 1, f"{kind} is not last"
            assert not (text or reasoning or spans or calls or steps), (text, reasoning, spans,
                                                                        calls, steps)
        elif kind == "TEXT_MESSAGE_START":
            opened(text, message)
        elif kind == "TEXT_MESSAGE_CONTENT":
            inside(text, message)
        elif kind == "TEXT_MESSAGE_END":
            closed(text, message)
        elif kind == "REASONING_START":
            opened(spans, message)
        elif kind == "REASONING_END":
            assert message not in reasoning, "the span ends before its message"
            closed(spans, message)
        elif kind == "REASONING_MESSAGE_START":
            inside(spans, message)
            opened(reasoning, message)
        elif kind == "REASONING_MESSAGE_CONTENT":
            inside(reasoning, message)
        elif kind == "REASONING_MESSAGE_END":
            closed(reasoning, message)
        elif kind == "TOOL_CALL_START":
            assert call not in ended, f"{call} started again"
            opened(calls, call)
        elif kind == "TOOL_CALL_ARGS":
            inside(calls, call)
        elif kind == "TOOL_CALL_END":
            closed(calls, call)
            ended.add(call)
        elif kind == "TOOL_CALL_RESULT":
            assert call in ended and call not in calls, f"{call}: no ended call"
        elif kind == "STEP_STARTED":
            opened(steps, event["stepName"])
        elif kind == "STEP_FINISHED":
            closed(steps, event["stepName"])
    assert events[-1]["type"] in TERMINAL, events[-1]
