"""Series-parallel decomposition of a plan, and its Celery canvas.

A plan whose DAG is series-parallel is written as nested chains and groups without adding a
dependency the plan does not have: `chain(X, Y)` is used only where every action of Y waits
(transitively) for every action of X. Other DAGs return None and run on readiness dispatch.

A chain's message carries every later step of the chain, and each step passes the rest on:
a chain of n steps moves n²/2 step signatures through the broker and its workers, and each
hop JSON-decodes them twice (the worker's consumer, then its pool process) and encodes them
once. A chain that `to_canvas` builds therefore sends its plain steps in a compact form,
`{"subtask_type": "cortex.step", "task", "args", "queue"}` (126 bytes and two JSON containers
with a 32-character job id, instead of Celery's 230 bytes and four), which a worker turns
back into the same signature (see `CompactStep`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery.canvas import Signature, chain, group

from cortex_worker.plan.dag import Plan

#: The `subtask_type` of a chain step in compact form.
COMPACT_STEP = "cortex.step"


@dataclass(frozen=True, slots=True)
class Step:
    """A node of the decomposition: `kind` is "task", "chain" or "group"."""

    kind: str
    id: str = ""
    parts: tuple[Step, ...] = ()

    def width(self) -> int:
        """The most actions this structure can run at once."""
        if self.kind == "task":
            return 1
        widths = [p.width() for p in self.parts]
        return sum(widths) if self.kind == "group" else max(widths)

    def shape(self) -> Any:
        """A plain nested form for tests and logs: "a", ("chain", [...]), ("group", [...])."""
        if self.kind == "task":
            return self.id
        return (self.kind, [p.shape() for p in self.parts])


def decompose(plan: Plan) -> Step | None:
    """The series-parallel structure of `plan`, or None if it has none (or has errors)."""
    if not plan.ok or not plan.nodes:
        return None
    order = plan.topological_order()
    if len(order) != len(plan.nodes):
        return None
    index = {node_id: i for i, node_id in enumerate(order)}
    preds = {n: [p for p in plan.waits_for(n) if p in index] for n in order}
    ancestors: dict[str, int] = {}
    for n in order:  # bitsets over topological positions
        mask = 0
        for p in preds[n]:
            mask |= ancestors[p] | (1 << index[p])
        ancestors[n] = mask
    return _split(order, preds, ancestors, index)


def _split(nodes: Sequence[str], preds: Mapping[str, list[str]], ancestors: Mapping[str, int],
           index: Mapping[str, int]) -> Step | None:
    if len(nodes) == 1:
        return Step("task", nodes[0])
    components = _components(nodes, preds)
    if len(components) > 1:
        parts = [_split(c, preds, ancestors, index) for c in components]
        if any(p is None for p in parts):
            return None
        return Step("group", parts=tuple(p for p in parts if p is not None))
    # Series: cut wherever every later node waits for every earlier one (all cuts at once).
    common = -1
    suffix_common = [0] * len(nodes)
    for k in range(len(nodes) - 1, 0, -1):
        common &= ancestors[nodes[k]]
        suffix_common[k] = common
    cuts, prefix = [0], 0
    for k in range(1, len(nodes)):
        prefix |= 1 << index[nodes[k - 1]]
        if prefix & ~suffix_common[k] == 0:
            cuts.append(k)
    if len(cuts) == 1:
        return None
    cuts.append(len(nodes))
    parts: list[Step] = []
    for start, end in itertools.pairwise(cuts):
        part = _split(nodes[start:end], preds, ancestors, index)
        if part is None:
            return None
        parts.extend(_flat(part))
    return Step("chain", parts=tuple(parts))


def _flat(step: Step) -> tuple[Step, ...]:
    return step.parts if step.kind == "chain" else (step,)


def _components(nodes: Sequence[str], preds: Mapping[str, list[str]]) -> list[list[str]]:
    """Weakly connected components of the induced subgraph, each in topological order."""
    members = set(nodes)
    parent = {n: n for n in nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in nodes:
        for p in preds[n]:
            if p in members:
                parent[find(n)] = find(p)
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def to_canvas(step: Step, signature: Callable[[str], Any]) -> Any:
    """Build the Celery canvas of `step`; `signature(id)` gives an immutable task signature."""
    if step.kind == "task":
        return signature(step.id)
    parts = [to_canvas(p, signature) for p in step.parts]
    if step.kind == "group":
        return group(*parts)
    built = chain(*parts)  # Celery's reading: a group followed by a step is a chord
    return CompactChain(built.tasks, app=built.app) if built.subtask_type == "chain" else built


class CompactChain(chain):
    """A chain whose message carries its later plain steps in compact form (`compact`).
    Anything else (arguments, options, eager mode) runs as Celery's chain does."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if args or kwargs or options or self.options or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, **options)
        steps, results = self.prepare_steps((), {}, self.tasks, app=self.app)
        first = steps.pop()  # the later steps come last to first: a worker pops the next one
        sent = first.apply_async(chain=[compact(s) for s in steps])
        return results[0] if steps else sent


_PLAIN_KEYS = {"task", "args", "kwargs", "options", "subtask_type", "immutable", "chord_size"}
_PLAIN_OPTIONS = {"queue", "task_id", "reply_to"}


def compact(step: Any) -> Any:
    """A chain step as its chain's message carries it: compact if that loses nothing a step of
    a Cortex canvas uses (an immutable task with positional arguments, a queue, and the task
    id `":".join(args)`; `reply_to` only matters to Celery's RPC result backend), else as is."""
    if not (type(step) is Signature and step.immutable and not step.kwargs
            and set(step) <= _PLAIN_KEYS and not step.get("chord_size")
            and set(step.options) <= _PLAIN_OPTIONS and step.options.get("queue")
            and all(isinstance(a, str) for a in step.args)
            and step.options.get("task_id") == ":".join(step.args)):
        return step
    return {"subtask_type": COMPACT_STEP, "task": step.task, "args": list(step.args),
            "queue": step.options["queue"]}


@Signature.register_type(name=COMPACT_STEP)
class CompactStep(Signature):
    """Expands a compact chain step (`compact`) when a worker takes it from its chain; Celery
    finds it by `subtask_type`. Every worker registers it when it imports this module."""

    @classmethod
    def from_dict(cls, d: dict[str, Any], app: Any = None) -> Signature:
        args = list(d["args"])
        # argsrepr and kwargsrepr as Celery would write them for these plain strings, without
        # its slower saferepr on every hop (the message's headers, shown by Flower)
        return Signature(d["task"], args=args, immutable=True, app=app,
                         options={"queue": d["queue"], "task_id": ":".join(args),
                                  "argsrepr": repr(tuple(args)), "kwargsrepr": "{}"})
