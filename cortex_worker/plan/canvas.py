"""Series-parallel decomposition of a plan, and its Celery canvas.

A plan whose DAG is series-parallel is written as nested chains and groups without adding a
dependency the plan does not have: `chain(X, Y)` is used only where every action of Y waits
(transitively) for every action of X. Other DAGs return None and run on readiness dispatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cortex_worker.plan.dag import Plan


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
    from celery import chain, group

    if step.kind == "task":
        return signature(step.id)
    parts = [to_canvas(p, signature) for p in step.parts]
    return chain(*parts) if step.kind == "chain" else group(*parts)
