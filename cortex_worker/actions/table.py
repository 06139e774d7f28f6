"""The action-type table: one row per `type`, each declared by its module in `types/`.

A new type is one module there (its `TYPE` row, see `types.base.ActionType`) and one line in
`_MODULES`; the parser's type names, the feed sources, the workflow step types and the body
keys that may name a target all derive from this table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from cortex_worker.actions.types import agent, internal, llm, relic, tool, workflow
from cortex_worker.actions.types.base import (
    DOCUMENT,
    MANIFEST,
    ActionType,
    Problem,
    Tables,
    Target,
    Wording,
)

__all__ = ["ACTION_TYPES", "DOCUMENT", "FEED_SOURCES", "MANIFEST", "TARGET_KEYS",
           "WORKFLOW_STEPS", "ActionType", "Problem", "Tables", "Target", "Wording",
           "queue_of", "runner_of"]

_MODULES = (tool, llm, agent, relic, workflow, internal)
"""In the order prompts, grammars and error messages list the types."""

ACTION_TYPES: dict[str, ActionType] = {module.TYPE.name: module.TYPE for module in _MODULES}
TARGET_KEYS: tuple[str, ...] = tuple(name for name, row in ACTION_TYPES.items() if row.keyed)
"""The types whose own key may name an action's target (`{"tool": "search"}`)."""
FEED_SOURCES: tuple[str, ...] = tuple(n for n, row in ACTION_TYPES.items() if row.feed_source)
WORKFLOW_STEPS: tuple[str, ...] = tuple(
    n for n, row in ACTION_TYPES.items() if row.workflow_step)


def queue_of(registry: Tables, spec: Mapping[str, Any]) -> str:
    """The pool queue of an action spec."""
    return ACTION_TYPES[spec["type"]].queue(registry, spec["name"])


@cache
def runner_of(type_name: str) -> Callable[[Any], Any]:
    """The function that runs actions of this type (imported on first use)."""
    module, _, function = ACTION_TYPES[type_name].runner.partition(":")
    return getattr(importlib.import_module(module), function)
