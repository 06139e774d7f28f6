"""The planner: what each action waits for, decided one action at a time (protocol.md, the plan).

`StreamPlanner.place` is the one place the dependency rules are written. The coordinator calls
it (through `add`) for each action of an agent's turn as the model streams it; `build_plan`
(dag.py) calls it for every action of a whole document in document order and then adds what
needs the whole document (duplicate ids, forward references, unknown dependencies, cycles,
unknown-reference warnings). The rules:

- `depends_on`: the explicit ids, then one producer per `$name` in the parameters: the latest
  action before it that produces `name` (as its id, its `output_key`, or the variable of an
  internal `set_variable` / `add_context_feed`). `producers` holds that latest producer per
  name. A `known` name (a context feed, an input) counts as produced before the first action.
- a `$name` that only the action itself produces (its id or output key) is a self loop; the
  self edge is left out of `depends_on` and reported as `self_loop`.
- a `$name` with no producer yet is `unbound`: a stream leaves it as written (the action is
  dispatched before any later action is written); a whole document binds it to the first
  producer after it, unless the action produces that name itself.
- an explicit dependency on an id not seen yet is `waiting` until that id arrives; one still
  waiting at the end of the stream is an unknown dependency.
- `after`: the nearest sync action before it (the barrier), unless that one is in `depends_on`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cortex_worker.protocol.actions import Action, ActionMode, ActionType
from cortex_worker.protocol.variables import find_references

__all__ = ["INTERNAL_PRODUCERS", "Placement", "StreamPlanner", "produces"]

INTERNAL_PRODUCERS = {"set_variable": "name", "add_context_feed": "id"}
"""Internal actions that produce a variable, and the parameter that names it."""


def produces(action: Action) -> tuple[str, ...]:
    """The names `action` produces: its id, its output key, the variable it sets if internal."""
    names = [action.id]
    if action.output_key:
        names.append(action.output_key)
    key = INTERNAL_PRODUCERS.get(action.name) if action.type == ActionType.internal else None
    value = action.parameters.get(key) if key else None
    if isinstance(value, str) and value.strip():
        names.append(value.strip())
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True, slots=True)
class Placement:
    """What `StreamPlanner.place` decided for one action."""

    action: Action
    depends_on: tuple[str, ...]  # sorted, never the action itself
    after: tuple[str, ...]  # () or the barrier
    self_loop: bool = False  # it depends on itself, explicitly or through its own id/output key
    unbound: tuple[str, ...] = ()  # referenced names with no producer yet, sorted


@dataclass
class StreamPlanner:
    """The planner's state after the actions placed so far (for a job: all its turns)."""

    producers: dict[str, str] = field(default_factory=dict)  # name -> its latest producer
    ids: set[str] = field(default_factory=set)
    last_sync: str | None = None
    waiting: dict[str, list[str]] = field(default_factory=dict)  # action -> unseen deps
    known: frozenset[str] = frozenset()  # names available before the first action
    # unseen id -> the actions waiting for it (derived from `waiting`; may hold stale entries)
    _waiters: dict[str, list[str]] | None = field(default=None, init=False, repr=False,
                                                  compare=False)

    def place(self, action: Action) -> Placement:
        """Record `action` (its id must be new) and decide what it waits for."""
        own = (action.id, action.output_key)
        deps = dict.fromkeys(action.depends_on)  # an ordered set: explicit ones first
        unbound: list[str] = []
        self_loop = False
        for name in sorted(find_references(action.parameters)):
            producer = self.producers.get(name)
            if producer is not None:
                deps[producer] = None  # the latest producer before it
            elif name in self.known:
                continue  # produced before the first action
            elif name in own:
                self_loop = True  # uses its own result: it can never run
            else:
                unbound.append(name)
        if action.id in deps:  # explicitly, or an id placed twice
            self_loop = True
            del deps[action.id]
        waiters = self._waiting_for()
        unseen = [d for d in deps if d not in self.ids and d not in self.known]
        if unseen:
            self.waiting[action.id] = unseen
            for dep in unseen:
                waiters.setdefault(dep, []).append(action.id)
        barrier = self.last_sync
        after = (barrier,) if barrier is not None and barrier not in deps else ()

        self.ids.add(action.id)
        for waiter in waiters.pop(action.id, ()):
            missing = self.waiting.get(waiter)
            if missing and action.id in missing:
                missing.remove(action.id)
                if not missing:
                    del self.waiting[waiter]
        for name in produces(action):
            self.producers[name] = action.id
        if action.mode == ActionMode.sync:
            self.last_sync = action.id
        return Placement(action, tuple(sorted(deps)), after, self_loop, tuple(unbound))

    def _waiting_for(self) -> dict[str, list[str]]:
        if self._waiters is None:
            self._waiters = {}
            for waiter, missing in self.waiting.items():
                for dep in missing:
                    self._waiters.setdefault(dep, []).append(waiter)
        return self._waiters

    def add(self, action: Action) -> tuple[list[str], list[str]]:
        """Record `action`; return its (depends_on, after) lists."""
        placed = self.place(action)
        return list(placed.depends_on), list(placed.after)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"producers": self.producers, "ids": sorted(self.ids),
                                "last_sync": self.last_sync, "waiting": self.waiting}
        if self.known:
            data["known"] = sorted(self.known)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamPlanner:
        return cls(producers=dict(data.get("producers", {})), ids=set(data.get("ids", [])),
                   last_sync=data.get("last_sync"),
                   waiting={k: list(v) for k, v in data.get("waiting", {}).items()},
                   known=frozenset(data.get("known", ())))
