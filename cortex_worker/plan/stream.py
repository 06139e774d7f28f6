"""Planning actions one at a time, as a model writes them (the streaming twin of `dag.py`).

The rules are the same as `build_plan`'s: explicit and implicit dependencies, and the nearest
earlier sync action as a barrier. A `$name` not produced yet is not a dependency (it is left as
written when the action runs); an explicit dependency on an id not seen yet waits until the end
of the generation, and is an error then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cortex_worker.protocol.actions import Action
from cortex_worker.protocol.variables import find_references

PRODUCING_INTERNAL = {"set_variable": "name", "add_context_feed": "id"}


@dataclass
class StreamPlanner:
    """Dependencies of each new action, from what the job has produced so far (all turns)."""

    producers: dict[str, str] = field(default_factory=dict)  # variable name -> action id
    ids: set[str] = field(default_factory=set)
    last_sync: str | None = None
    waiting: dict[str, list[str]] = field(default_factory=dict)  # action -> unseen deps

    def add(self, action: Action) -> tuple[list[str], list[str]]:
        """Record `action`; return its (depends_on, after) lists."""
        deps = list(dict.fromkeys(action.depends_on))
        for name in sorted(find_references(action.parameters)):
            producer = self.producers.get(name)
            if producer and producer != action.id and producer not in deps:
                deps.append(producer)
        unseen = [d for d in deps if d not in self.ids]
        if unseen:
            self.waiting[action.id] = unseen
        after = [self.last_sync] if self.last_sync and self.last_sync not in deps else []
        self.ids.add(action.id)
        for waiter, missing in list(self.waiting.items()):
            if action.id in missing:
                missing.remove(action.id)
                if not missing:
                    del self.waiting[waiter]
        self.producers[action.id] = action.id
        if action.output_key:
            self.producers[action.output_key] = action.id
        key = PRODUCING_INTERNAL.get(action.name) if action.type.value == "internal" else None
        if key and isinstance(action.parameters.get(key), str):
            self.producers[action.parameters[key]] = action.id
        if action.mode.value == "sync":
            self.last_sync = action.id
        return sorted(deps), after

    def to_json(self) -> dict[str, Any]:
        return {"producers": self.producers, "ids": sorted(self.ids),
                "last_sync": self.last_sync, "waiting": self.waiting}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamPlanner:
        return cls(producers=dict(data.get("producers", {})), ids=set(data.get("ids", [])),
                   last_sync=data.get("last_sync"), waiting=dict(data.get("waiting", {})))
