"""Series-parallel decomposition of a plan, and its Celery canvas.

A plan whose DAG is series-parallel is written as nested chains and groups without adding a
dependency the plan does not have: `chain(X, Y)` is used only where every action of Y waits
(transitively) for every action of X. Other DAGs return None and run on readiness dispatch.

A chain's message carries every later step of the chain, and each step passes the rest on:
a chain of n steps moves n²/2 step signatures through the broker and its workers, and each
hop JSON-decodes them twice (the worker's consumer, then its pool process) and encodes them
once. A chain that `to_canvas` builds therefore sends each run of consecutive plain steps
(one job's `cortex.action` tasks on one queue, at one priority) as one entry naming their
action ids, `{"subtask_type": "cortex.steps", "task", "job", "ids", "queue"[, "priority"]}`:
a few bytes a step instead of Celery's 230 (see `StepRun`). A worker turns the entry back
into its first step, whose own message carries the rest of the run.

A step also carries its action's spec when the step before it, in the same worker thread,
has it at hand (`hand_on`): an action's claim returns the specs of the dependents its success
alone makes ready, and the step sends the chain's next step itself (`forward`) as soon as its
action has succeeded, before its finish, so that step does not read its spec again.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery.canvas import Signature, chain, group, maybe_signature

from cortex_worker.plan.dag import Plan

#: The `subtask_type` of a run of chain steps in compact form.
STEP_RUN = "cortex.steps"
#: The `subtask_type` of one compact chain step, as an earlier version sent it.
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
        sent = first.apply_async(chain=compact(steps))
        return results[0] if steps else sent


_PLAIN_KEYS = {"task", "args", "kwargs", "options", "subtask_type", "immutable", "chord_size"}
_PLAIN_OPTIONS = {"queue", "task_id", "reply_to", "priority"}


def _plain(step: Any) -> tuple[str, str, str, int | None] | None:
    """(task, job id, queue, priority) of a step a run can hold: an immutable task of two
    string arguments (job id, action id) and the task id `job:action`, with a queue and at
    most a priority (`reply_to` only matters to Celery's RPC result backend); else None."""
    if not (type(step) is Signature and step.immutable and not step.kwargs
            and set(step) <= _PLAIN_KEYS and not step.get("chord_size")
            and set(step.options) <= _PLAIN_OPTIONS and step.options.get("queue")
            and len(step.args) == 2 and all(isinstance(a, str) for a in step.args)
            and step.options.get("task_id") == ":".join(step.args)):
        return None
    return step.task, step.args[0], step.options["queue"], step.options.get("priority")


def compact(steps: Sequence[Any]) -> list[Any]:
    """A chain's later steps (last to first) as its message carries them: each run of
    consecutive plain steps alike (`_plain`) as one `StepRun` entry, any other step as is."""
    out: list[Any] = []
    for step in steps:  # last to first: a run's ids are gathered backwards, then reversed
        kind = _plain(step)
        last = out[-1] if out and isinstance(out[-1], _Run) else None
        if kind is not None and last is not None and last.kind == kind:
            last.ids.append(step.args[1])
        elif kind is not None:
            out.append(_Run(kind, [step.args[1]]))
        else:
            out.append(step)
    return [entry.entry() if isinstance(entry, _Run) else entry for entry in out]


@dataclass(slots=True)
class _Run:
    kind: tuple[str, str, str, int | None]
    ids: list[str]  # last to first

    def entry(self) -> dict[str, Any]:
        task, job, queue, priority = self.kind
        out = {"subtask_type": STEP_RUN, "task": task, "job": job, "ids": self.ids[::-1],
               "queue": queue}
        if priority is not None:
            out["priority"] = priority
        return out


class _Handoff(threading.local):
    """The specs a step of this thread made ready, by task id (`hand_on`), and whether they
    are sent ahead of its finish."""

    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}
        self.ahead = False


_handoff = _Handoff()


def hand_on(job_id: str, specs: Sequence[dict[str, Any]], *, ahead: bool = False) -> None:
    """Keep the specs of the actions a canvas step's end makes ready for the chain's next step,
    which this thread sends next (`forward`, or Celery's tracer once the task returns): it
    then carries its spec and does not read it (`ahead`: and says it went before that end
    was recorded). Only the latest step's are kept."""
    _handoff.specs = {f"{job_id}:{spec['id']}": spec for spec in specs}
    _handoff.ahead = ahead


def forward(task: Any, job_id: str, specs: Sequence[dict[str, Any]]
            ) -> tuple[list[str], Callable[[], None] | None]:
    """How the running canvas step's next step goes ahead of this step's finish, when it is a
    plain step whose action this step's success alone makes ready (its claim foresaw
    `specs`): its action id, and what sends it as Celery's tracer would once the task returns
    (the tracer then finds no chain left to send). Else nothing: the tracer sends the rest.
    A step sent ahead that still comes before that finish is not ready, and comes back
    (executor.py)."""
    request = task.request
    following = request.chain[-1] if request.chain else None
    if not (isinstance(following, dict) and following.get("subtask_type") == STEP_RUN
            and following["job"] == job_id
            and following["ids"][0] in {spec["id"] for spec in specs}):
        return [], None

    def send() -> None:
        hand_on(job_id, specs, ahead=True)
        rest = request.chain[:-1]
        request.chain = None
        app = task.app
        priority = (request.delivery_info or {}).get("priority") \
            if app.conf.task_inherit_parent_priority else None
        app.amqp._retry_publish(maybe_signature(following, app=app).apply_async, (),
                                chain=rest, parent_id=request.id,
                                root_id=request.root_id or request.id, priority=priority)

    return [following["ids"][0]], send


def _step(task: str, job_id: str, action_id: str, queue: str, priority: int | None,
          app: Any, cls: type[Signature] = Signature) -> Signature:
    """One canvas step as a worker sends it: with its spec if this thread has it (`hand_on`).
    argsrepr and kwargsrepr as Celery would write them for the ids, without its slower
    saferepr on every hop (the message's headers, shown by Flower)."""
    task_id = f"{job_id}:{action_id}"
    spec = _handoff.specs.pop(task_id, None)
    args: list[Any] = [job_id, action_id] if spec is None else [job_id, action_id, spec, False]
    if spec is not None and _handoff.ahead:
        args.append(True)
    options: dict[str, Any] = {"queue": queue, "task_id": task_id,
                               "argsrepr": repr((job_id, action_id)), "kwargsrepr": "{}"}
    if priority is not None:
        options["priority"] = priority
    return cls(task, args=args, immutable=True, app=app, options=options)


@Signature.register_type(name=STEP_RUN)
class StepRun(Signature):
    """The first step of a run of chain steps (`compact`), expanded when a worker takes the
    run from its chain (Celery finds it by `subtask_type`; every worker registers it when it
    imports this module). Sending it puts the rest of the run back on the chain."""

    rest: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], app: Any = None) -> Signature:
        first, *later = d["ids"]
        step = _step(d["task"], d["job"], first, d["queue"], d.get("priority"), app, cls)
        step.rest = {**d, "ids": later} if later else None
        return step

    def apply_async(self, args: Any = None, kwargs: Any = None, route_name: Any = None,
                    **options: Any) -> Any:
        if self.rest is not None:  # the rest of the run comes next: the end of the chain
            options["chain"] = [*(options.get("chain") or ()), self.rest]
        return super().apply_async(args, kwargs, route_name, **options)


@Signature.register_type(name=COMPACT_STEP)
class CompactStep(Signature):
    """One compact chain step, as messages sent by an earlier version carry it."""

    @classmethod
    def from_dict(cls, d: dict[str, Any], app: Any = None) -> Signature:
        job_id, action_id = d["args"]
        return _step(d["task"], job_id, action_id, d["queue"], None, app)
