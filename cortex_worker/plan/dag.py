"""The plan of a protocol document: its actions as a dependency graph (protocol.md, the plan).

`build_plan` is the stream planner (`StreamPlanner.place`, stream.py, where every dependency
rule is written) applied to each action in document order, plus what needs the whole document:

- a later action whose id is already used is dropped (`duplicate_id`);
- a `$reference` with no producer before it binds to the first producer after it (a stream
  cannot: it has dispatched the action before the producer is written); one that names
  nothing at all is a warning (the text is left as written);
- an explicit dependency on an id that never appears is an error (`unknown_dependency`), and
  so are cycles (`cycle`), self loops included.

Every graph walk is iterative and linear in nodes + edges, so 10k-action plans are fine.
A `Plan` is a snapshot: treat `nodes` as read-only (derived indexes are cached).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cortex_worker.plan.stream import Placement, StreamPlanner, produces
from cortex_worker.protocol.actions import Action

__all__ = ["Plan", "PlanIssue", "PlanNode", "build_plan"]


@dataclass(frozen=True, slots=True)
class PlanIssue:
    """A problem found while planning: an error (`Plan.errors`) or a warning (`Plan.warnings`).

    Error kinds: `duplicate_id`, `unknown_dependency`, `cycle`. Warning kind: `unknown_reference`.
    """

    kind: str
    message: str
    line: int
    column: int
    action_id: str | None


@dataclass(slots=True)
class PlanNode:
    """One action in the plan with its resolved edges.

    `depends_on`: explicit ∪ implicit dependencies, sorted, never the action itself.
    `after`: the nearest preceding sync action (the barrier it waits for), unless that action
    is already in `depends_on`.
    """

    action: Action
    depends_on: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return self.action.id


class Plan:
    """The DAG of one document's actions, with the issues found while building it."""

    def __init__(
        self,
        nodes: dict[str, PlanNode],
        errors: list[PlanIssue] | None = None,
        warnings: list[PlanIssue] | None = None,
        *,
        known: Iterable[str] = (),
        self_loops: Iterable[str] = (),
    ) -> None:
        self.nodes = nodes
        self.errors = list(errors or [])
        self.warnings = list(warnings or [])
        # Ids outside this plan that count as already available (e.g. earlier turns).
        self.known = frozenset(known)
        # Actions that depend on themselves; `depends_on` omits the self edge.
        self.self_loops = frozenset(self_loops)
        self._dependents: dict[str, tuple[str, ...]] | None = None
        self._order: list[str] | None = None

    def __repr__(self) -> str:
        return (
            f"Plan(nodes={len(self.nodes)}, errors={len(self.errors)}, "
            f"warnings={len(self.warnings)})"
        )

    @property
    def ok(self) -> bool:
        """True when the plan has no errors (warnings are allowed)."""
        return not self.errors

    def waits_for(self, action_id: str) -> tuple[str, ...]:
        """Every id the action waits for before dispatch: `depends_on` then `after`."""
        try:
            node = self.nodes[action_id]
        except KeyError:
            raise KeyError(f"no action {action_id!r} in this plan") from None
        return node.depends_on + node.after

    def dependents(self, action_id: str) -> tuple[str, ...]:
        """Ids of the actions that wait for `action_id` (directly), in stream order."""
        if self._dependents is None:
            reverse: dict[str, list[str]] = {}
            for node_id, node in self.nodes.items():
                for dep in node.depends_on + node.after:
                    reverse.setdefault(dep, []).append(node_id)
            self._dependents = {key: tuple(value) for key, value in reverse.items()}
        return self._dependents.get(action_id, ())

    def _schedule(self) -> tuple[list[str], dict[str, int]]:
        """Kahn's algorithm: the schedulable ids in a topological order, and each one's level.

        Actions in a cycle, depending on themselves or on an id that is neither in the plan nor
        known, and everything that (transitively) waits for those, are left out.
        """
        pending: dict[str, int] = {}
        blocked: set[str] = set(self.self_loops)
        for node_id, node in self.nodes.items():
            count = 0
            for dep in node.depends_on + node.after:
                if dep in self.nodes:
                    count += 1
                elif dep not in self.known:
                    blocked.add(node_id)
            pending[node_id] = count
        order = [i for i, count in pending.items() if count == 0 and i not in blocked]
        level = dict.fromkeys(order, 0)
        position = 0
        while position < len(order):
            current = order[position]
            position += 1
            next_level = level[current] + 1
            for child in self.dependents(current):
                if level.get(child, -1) < next_level:
                    level[child] = next_level
                pending[child] -= 1
                if pending[child] == 0 and child not in blocked:
                    order.append(child)
        return order, {i: level[i] for i in order}

    def waves(self) -> list[list[str]]:
        """Levels of the DAG: wave k holds the actions whose longest chain of waits has length k.

        Ids within a wave are in stream order. Blocked actions (see `_schedule`) are excluded.
        """
        _, level = self._schedule()
        waves: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
        for node_id in self.nodes:
            if node_id in level:
                waves[level[node_id]].append(node_id)
        return waves

    def topological_order(self) -> list[str]:
        """The schedulable ids, each after everything it waits for: the waves, flattened."""
        if self._order is None:
            self._order = [node_id for wave in self.waves() for node_id in wave]
        return list(self._order)

    def critical_path(
        self, estimates: Mapping[str, float] | None = None, default: float = 1.0
    ) -> tuple[list[str], float]:
        """The longest weighted chain of waits, from first to last action, and its total.

        Each action weighs `estimates.get(id, default)`. Ties go to the action earliest in the
        stream. Blocked actions are ignored. An empty plan gives `([], 0.0)`.
        """
        estimates = estimates or {}
        index = {node_id: i for i, node_id in enumerate(self.nodes)}
        total: dict[str, float] = {}
        previous: dict[str, str | None] = {}
        for node_id in self.topological_order():
            best: str | None = None
            for dep in self.waits_for(node_id):
                if dep not in total:
                    continue  # external (known) dependency
                if (
                    best is None
                    or total[dep] > total[best]
                    or (total[dep] == total[best] and index[dep] < index[best])
                ):
                    best = dep
            weight = float(estimates.get(node_id, default))
            total[node_id] = weight + (total[best] if best is not None else 0.0)
            previous[node_id] = best
        if not total:
            return [], 0.0
        end: str | None = None
        for node_id in self.nodes:  # stream order: the first maximum wins
            if node_id in total and (end is None or total[node_id] > total[end]):
                end = node_id
        assert end is not None
        path: list[str] = []
        cursor: str | None = end
        while cursor is not None:
            path.append(cursor)
            cursor = previous[cursor]
        path.reverse()
        return path, total[end]


def build_plan(actions: Sequence[Action], known: Iterable[str] = ()) -> Plan:
    """Build the plan of a document's actions (in stream order).

    `known` names variables and ids that exist outside this document (context feeds, results
    of earlier turns): they count as produced before the first action, so references to them
    are not warned about, and an explicit `depends_on` naming one is treated as already
    satisfied rather than as an unknown dependency.
    """
    planner = StreamPlanner(known=frozenset(known))
    errors: list[PlanIssue] = []
    warnings: list[PlanIssue] = []
    placed: dict[str, Placement] = {}
    for action in actions:
        first = placed.get(action.id)
        if first is not None:
            errors.append(PlanIssue(
                "duplicate_id",
                f"action id '{action.id}' is already used by the action at line "
                f"{first.action.line}, column {first.action.column}; this later action was "
                "dropped — give every action a unique id",
                action.line, action.column, action.id))
            continue
        placed[action.id] = planner.place(action)

    # A reference with no producer before it binds to the first producer after it, unless
    # the action produces that name itself (a set_variable reading the value before its own).
    forward: dict[str, dict[str, str]] = {}
    following: dict[str, str] = {}  # name -> the first producer after the current action
    for placement in reversed(placed.values()):
        action_id, own = placement.action.id, produces(placement.action)
        forward[action_id] = {n: following[n] for n in placement.unbound
                              if n in following and n not in own}
        for name in own:
            following[name] = action_id

    nodes: dict[str, PlanNode] = {}
    for action_id, placement in placed.items():
        action = placement.action
        depends_on = tuple(sorted({*placement.depends_on, *forward[action_id].values()}))
        nodes[action_id] = PlanNode(action, depends_on, placement.after)
        for name in placement.unbound:
            if name not in forward[action_id]:
                warnings.append(PlanIssue(
                    "unknown_reference",
                    f"${name} in action '{action_id}' names nothing known; "
                    "it will be left as written",
                    action.line, action.column, action_id))
    for action_id, missing in planner.waiting.items():
        action = placed[action_id].action
        errors.extend(
            PlanIssue("unknown_dependency",
                      f"action '{action_id}' depends on '{dep}', which is not an action "
                      "in this document", action.line, action.column, action_id)
            for dep in missing)
    self_loops = {i for i, placement in placed.items() if placement.self_loop}
    errors.extend(_cycle_issues(nodes, self_loops))
    return Plan(nodes, errors, warnings, known=planner.known, self_loops=self_loops)


def _strongly_connected(nodes: dict[str, PlanNode]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def edges(node_id: str) -> list[str]:
        node = nodes[node_id]
        return [dep for dep in node.depends_on + node.after if dep in nodes]

    for root in nodes:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(edges(root)))]
        while work:
            current, children = work[-1]
            descended = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges(child))))
                    descended = True
                    break
                if child in on_stack and index[child] < low[current]:
                    low[current] = index[child]
            if descended:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                if low[current] < low[parent]:
                    low[parent] = low[current]
            if low[current] == index[current]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == current:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def _cycle_issues(nodes: dict[str, PlanNode], self_loops: set[str]) -> list[PlanIssue]:
    """One `cycle` error per self-dependent action and per strongly connected component."""
    position = {node_id: i for i, node_id in enumerate(nodes)}
    found: list[tuple[int, PlanIssue]] = []
    for node_id in self_loops:
        action = nodes[node_id].action
        issue = PlanIssue(
            "cycle",
            f"dependency cycle: {node_id} -> {node_id}",
            action.line,
            action.column,
            node_id,
        )
        found.append((position[node_id], issue))

    for component in _strongly_connected(nodes):
        members = set(component)
        start = min(component, key=position.__getitem__)
        cycle = _shortest_cycle(nodes, members, start, position)
        message = "dependency cycle: " + " -> ".join([*cycle, start])
        barrier_edges = [
            (waiter, barrier)
            for waiter, barrier in zip(cycle, [*cycle[1:], start], strict=True)
            if barrier in nodes[waiter].after
        ]
        for waiter, barrier in barrier_edges:
            message += (
                f"; '{waiter}' waits for sync action '{barrier}' because it comes after it "
                "in the document"
            )
        rest = sorted(members.difference(cycle), key=position.__getitem__)
        if rest:
            message += "; also caught in it: " + ", ".join(rest)
        action = nodes[start].action
        found.append(
            (position[start], PlanIssue("cycle", message, action.line, action.column, start))
        )
    found.sort(key=lambda item: item[0])
    return [issue for _, issue in found]


def _shortest_cycle(
    nodes: dict[str, PlanNode], members: set[str], start: str, position: dict[str, int]
) -> list[str]:
    """Breadth-first search inside one component for the shortest cycle through `start`."""
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    head = 0
    while head < len(queue):
        current = queue[head]
        head += 1
        node = nodes[current]
        children = sorted(
            (dep for dep in node.depends_on + node.after if dep in members),
            key=position.__getitem__,
        )
        for child in children:
            if child == start:
                path: list[str] = []
                cursor: str | None = current
                while cursor is not None:
                    path.append(cursor)
                    cursor = parent[cursor]
                path.reverse()
                return path
            if child not in parent:
                parent[child] = current
                queue.append(child)
    raise AssertionError(f"no cycle through {start!r} in its strongly connected component")
