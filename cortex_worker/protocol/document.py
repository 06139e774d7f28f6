"""A whole protocol document: its parse, its plan, and the stable `validate` JSON."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cortex_worker.plan.dag import Plan, build_plan
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.actions import Action


@dataclass
class Document:
    """What a document says: actions, thoughts, responses, loose text, feeds and problems."""

    actions: list[Action] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    feeds: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    events: list[p.ParseEvent] = field(default_factory=list)
    plan: Plan | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        """The stable `cortex validate --json` format (documented in docs/protocol.md)."""
        plan = self.plan
        assert plan is not None
        actions = []
        for node in plan.nodes.values():
            a = node.action
            actions.append({
                "id": a.id, "type": a.type.value, "mode": a.mode.value, "name": a.name,
                "parameters": a.parameters, "output_key": a.output_key,
                "depends_on": list(node.depends_on), "after": list(node.after),
                "in_thought": a.in_thought,
            })
        return {
            "actions": actions,
            "thoughts": self.thoughts,
            "responses": self.responses,
            "text": self.text,
            "errors": [_problem(e) for e in self.errors],
            "warnings": [_problem(w) for w in self.warnings],
            "waves": plan.waves(),
        }


def _problem(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: data[k] for k in ("kind", "message", "line", "column")}


def collect(events: Iterable[p.ParseEvent]) -> Document:
    """Fold parse events into a `Document` (without its plan)."""
    doc = Document()
    loose: list[str] = []

    def end_loose() -> None:
        if loose:
            piece = "".join(loose).strip()
            if piece:
                doc.text.append(piece)
            loose.clear()

    for event in events:
        doc.events.append(event)
        kind, data = event.type, event.data
        if kind == p.TEXT:
            loose.append(data["text"])
            continue
        end_loose()
        if kind == p.THOUGHT_END:
            doc.thoughts.append(data["text"].strip())
        elif kind == p.RESPONSE_END:
            doc.responses.append({"final": data["final"], "text": data["text"].strip()})
        elif kind == p.ACTION_PARSED:
            doc.actions.append(data["action"])
        elif kind == p.CONTEXT_FEED:
            doc.feeds[data["id"]] = data["value"]
        elif kind == p.PROTOCOL_ERROR:
            doc.errors.append(data)
        elif kind == p.WARNING:
            doc.warnings.append(data)
    end_loose()
    return doc


def load_document(text: str, *, chunk: int | None = None, known: Iterable[str] = ()) -> Document:
    """Parse `text` (fed `chunk` characters at a time when given) and plan its actions."""
    parser = p.StreamParser()
    if chunk and chunk > 0:
        events: list[p.ParseEvent] = []
        for start in range(0, len(text), chunk):
            events += parser.feed(text[start:start + chunk])
    else:
        events = parser.feed(text)
    events += parser.close()
    doc = collect(events)
    doc.plan = build_plan(doc.actions, known=[*doc.feeds, *known])
    for issue in doc.plan.errors:
        doc.errors.append(_issue(issue))
    for issue in doc.plan.warnings:
        doc.warnings.append(_issue(issue))
    doc.errors.sort(key=lambda e: (e["line"], e["column"]))
    doc.warnings.sort(key=lambda e: (e["line"], e["column"]))
    return doc


def _issue(issue: Any) -> dict[str, Any]:
    return {"kind": issue.kind, "message": issue.message, "line": issue.line,
            "column": issue.column, "action_id": issue.action_id}
