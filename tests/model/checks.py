"""What a protocol document written for an agent must satisfy: it parses with no protocol
error (fed to the real `StreamParser` in the chunks it arrived in), and every action names one
of the agent's callables with parameters that callable's JSON Schema accepts.

Shared by tests/unit/test_grammar.py (documents sampled from the grammar) and the real-model
tests in this directory (documents SmolLM2 wrote).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

from cortex_worker.llm.grammar import Target
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.actions import Action


@dataclass
class Report:
    """One document: its protocol errors, its actions, and what is wrong with those."""

    errors: list[dict[str, Any]] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    """Actions that name nothing the agent has, or whose parameters the schema refuses."""
    final: bool = False
    """A final response was written."""

    @property
    def clean(self) -> bool:
        return not self.errors and not self.invalid


def check(chunks: Iterable[str], targets: list[Target]) -> Report:
    """Feed `chunks` to a fresh parser, in order, and check what it reports."""
    parser = p.StreamParser()
    events: list[p.ParseEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.close()
    report = Report()
    known = {(t.type, t.name): t for t in targets}
    for event in events:
        if event.type == p.PROTOCOL_ERROR:
            report.errors.append(event.data)
        elif event.type == p.RESPONSE_END and event.data["final"]:
            report.final = True
        elif event.type == p.ACTION_PARSED:
            action: Action = event.data["action"]
            report.actions.append(action)
            target = known.get((action.type.value, action.name))
            if target is None:
                report.invalid.append(f"{action.id}: {action.type.value} {action.name!r} is "
                                      "not one of the agent's")
                continue
            problems = sorted(Draft202012Validator(dict(target.parameters)).iter_errors(
                action.parameters), key=str)
            if problems:
                report.invalid.append(f"{action.id}: {action.name} parameters "
                                      f"{action.parameters!r}: {problems[0].message}")
    return report
