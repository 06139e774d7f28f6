"""Running one action on a pool worker: claim it, substitute, run, record once, pass it on.

Delivery is at least once; the `claim` and `finish` scripts make the result exactly once: a
redelivered task whose result is recorded does not run again, it only re-sends what its end
made ready (in case the worker died between recording and sending).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NoReturn, Protocol

from cortex_worker.actions import dispatch, fairness
from cortex_worker.actions.call import Call, ChildJob, Deferred
from cortex_worker.actions.table import ACTION_TYPES, runner_of
from cortex_worker.errors import SubmitError
from cortex_worker.handles import get_registry, get_store
from cortex_worker.llm import limits
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.stream import ModelError
from cortex_worker.observability import tracing
from cortex_worker.plan import canvas
from cortex_worker.protocol.events import EventType
from cortex_worker.protocol.variables import find_references, substitute
from cortex_worker.recovery import fencing
from cortex_worker.recovery.liveness import is_dead
from cortex_worker.recovery.owners import owner
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Fenced, Store, dumps
from cortex_worker.tools.errors import ToolError, ToolTimeout

log = logging.getLogger(__name__)

LEASE_GRACE_S = 30.0
FORESEE = 8
"""Dependents a claim foresees (lua/claim.lua): those the action's success alone makes ready,
whose messages go out before its finish, so a hop waits for no finish round trip."""
EARLY_RETRY_S = 0.01
"""A canvas step that came before its dependency's finish comes back after this, doubled at
each try (up to 5 s): that finish is on its way, or its action runs again."""


Ahead = tuple[list[str], Callable[[], Any] | None]
"""The dependents whose messages go out while an action's finish is on its way to Redis (their
action ids), and what sends them."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """How an action's message came, and what its task can do about it.

    `again(countdown)` delivers this same message again later (it raises: a canvas step keeps
    its place in its chain); without it a new readiness task is sent. `forward(specs)`: how a
    canvas step's next step goes ahead of its finish, if its action is among the foreseen
    `specs` (`canvas.forward`). `tries`: the times this message came back. `ahead`: it was
    sent ahead of its dependencies' finish."""

    again: Callable[[float], NoReturn] | None = None
    forward: Callable[[list[dict[str, Any]]], Ahead] | None = None
    tries: int = 0
    ahead: bool = False


class JobHooks(Protocol):
    """What the executor asks of the job layer above it, which installs itself at import
    (`cortex_worker.jobs.lifecycle`): arrows point down, calls up go through here."""

    def drained(self, store: Store, job_id: str) -> None:
        """Nothing is left to wait for: end the job, or take the agent's next turn."""

    def fail(self, store: Store, job_id: str, reason: str) -> None:
        """End the job `failed` now (fail_fast)."""

    def start_child(self, store: Store, job_id: str, action_id: str, child: ChildJob) -> None:
        """Start the child job an action asked for; raises `SubmitError` if it cannot run."""


class _JobLayer:
    """The job layer's hooks, once it is imported."""

    hooks: JobHooks | None = None


_layer = _JobLayer()


def install_job_hooks(hooks: JobHooks) -> None:
    """Called once by `cortex_worker.jobs.lifecycle` when it is imported."""
    _layer.hooks = hooks


def _jobs() -> JobHooks:
    if _layer.hooks is None:
        raise RuntimeError("no job layer installed: import cortex_worker.jobs.lifecycle first")
    return _layer.hooks


def action_timeout(spec: Mapping[str, Any]) -> float:
    """The action's own timeout, else its type's for its target (a tool's), else the default."""
    if spec.get("timeout"):
        return float(spec["timeout"])
    own = ACTION_TYPES[spec["type"]].timeout(get_registry(), spec["name"])
    return own if own is not None else get_settings().default_action_timeout_s


def execute(job_id: str, action_id: str, spec: dict[str, Any] | None, trigger: bool,
            delivery: Delivery = Delivery()) -> str:
    """Run one action; `trigger` sends its ready dependents (readiness dispatch).

    A canvas step (`trigger` false) carries its spec only if the step before it had it at
    hand (`canvas.hand_on`: a chain message holds every later step); else it is read here.
    When another delivery holds the action, `delivery.again(countdown)` has this one
    delivered again; without it a new readiness task is sent.
    """
    again = delivery.again
    store = get_store()
    if spec is None:
        spec = store.spec(job_id, action_id)
        if spec is None:
            return "stop"  # the job has expired
    wait = model_wait(store, job_id, spec)
    if wait is not None:  # nothing is claimed: it comes back when its endpoint takes requests
        if again is not None:
            again(wait)  # a canvas step keeps its place in its chain (its task retries)
        dispatch.send(job_id, [spec], countdown=wait)
        return "waiting"
    timeout = action_timeout(spec)
    lease = timeout + LEASE_GRACE_S
    caps = gates(job_id, spec)
    if not caps:
        return _claim_and_run(store, job_id, action_id, spec, trigger, timeout, lease, delivery)
    # capped (its tenant's actions in flight, its tool's max_concurrency): a slot of each
    # first, or none (nothing is claimed or logged while the action waits in line)
    holder = f"{job_id}:{action_id}"
    waiting = {"job_id": job_id, "spec": spec} if trigger else None
    taken: list[tuple[str, int]] = []
    for gate, limit in caps:
        if not store.take_slot(gate, holder, limit, lease, waiting):
            _give_back(store, taken, holder)
            if again is not None:
                again(1.0)  # a canvas step keeps its place in its chain (its task retries)
            store.throttle(job_id, action_id)  # it is sent again when a slot frees
            return "throttled"
        taken.append((gate, limit))
    state = ""

    def held_elsewhere(wait: float) -> NoReturn:
        nonlocal state
        state = "busy"
        assert again is not None
        again(wait)

    try:
        state = _claim_and_run(store, job_id, action_id, spec, trigger, timeout, lease,
                               replace(delivery, again=held_elsewhere) if again else delivery)
        return state
    finally:
        # "busy": another delivery of this action runs it, in the slots this one found its
        # holder had (a redelivered task): that delivery gives them back when it ends
        if state != "busy":
            _give_back(store, taken, holder)


def model_wait(store: Store, job_id: str, spec: Mapping[str, Any]) -> float | None:
    """Seconds an action on the job's model must wait before it runs, when its endpoint is
    paused or out of the provider's count for longer than `limits.HOLD_S`; else None. The job
    hears why (`model_waiting`); the action waits in its queue, not in a worker slot that other
    actions, on other endpoints too, could use (a wait that starts once it runs is spent in
    its thread, in line)."""
    if not ACTION_TYPES[spec["type"]].needs_model or not spec.get("model"):
        return None
    known = limits.known_wait(store, ModelConfig.from_wire(spec["model"]))
    if known is None:
        return None
    endpoint, reason, wait_s = known
    store.wait_for_model(job_id, spec["id"], time.time() + wait_s)  # its message is not lost
    store.emit(job_id, [(EventType.model_waiting, {
        "endpoint": endpoint, "reason": reason, "action_id": spec["id"],
        "wait_s": round(wait_s, 3)})], live=True)
    return wait_s


def gates(job_id: str, spec: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The caps on actions running at once that the action must take a slot of, in order:
    its tenant's (`fairness.tenant_gate`), then its tool's `max_concurrency`."""
    out: list[tuple[str, int]] = []
    tenant = fairness.tenant_gate(job_id)
    if tenant is not None:
        out.append(tenant)
    limit = ACTION_TYPES[spec["type"]].concurrency(get_registry(), spec["name"])
    if limit is not None:
        out.append((f"tool:{spec['name']}", limit))
    return out


def _give_back(store: Store, taken: list[tuple[str, int]], holder: str) -> None:
    """Give back the slots `holder` took, and send the actions that waited for them."""
    for gate, limit in reversed(taken):
        for entry in store.give_slot(gate, holder, limit):
            dispatch.send(entry["job_id"], [entry["spec"]])


def _claim_and_run(store: Store, job_id: str, action_id: str, spec: dict[str, Any],
                   trigger: bool, timeout: float, lease: float, delivery: Delivery) -> str:
    again = delivery.again
    names = sorted(find_references(spec.get("parameters", {})))
    claim = store.claim(job_id, action_id, owner(), lease, names, ahead=delivery.ahead,
                        foresee=FORESEE)
    if claim[0] == "busy" and is_dead(store, claim[1]):  # its holder died: take it over
        claim = store.claim(job_id, action_id, owner(), lease, names, force=True,
                            ahead=delivery.ahead, foresee=FORESEE)
    state = claim[0]
    if state == "busy":
        # Another delivery runs it. Look again when its lease runs out (at most 5 s from now),
        # in a later delivery: nothing waits in this worker slot. A canvas step must not end
        # before its action has (its chain would move on), so the step itself comes back
        # (`again`); a readiness task is sent again.
        wait = max(0.5, min(float(claim[2]) - time.time(), 5.0))
        if again is not None:
            again(wait)
        dispatch.send(job_id, [spec], countdown=wait)
        return "busy"
    if state == "blocked" and delivery.ahead and again is not None:
        # A canvas step sent ahead of its dependency's finish, which has not landed yet: it
        # keeps its place in its chain and comes back (a readiness message is dropped, and
        # that finish sends it again: lua/claim.lua).
        again(min(EARLY_RETRY_S * 2 ** delivery.tries, 5.0))
    if state != "run":
        if state == "done" and trigger:
            dispatch.send(job_id, store.queued_dependents(job_id, action_id))
            _jobs().drained(store, job_id)
        return state

    attempt = int(claim[1])
    values, foreseen = claim[2:2 + len(names)], [json.loads(s) for s in claim[2 + len(names):]]
    lookup = {n: json.loads(v) for n, v in zip(names, values, strict=True) if v is not None}
    params, unresolved = substitute(spec.get("parameters", {}), lookup)
    if unresolved:
        store.emit(job_id, [("warning", {
            "kind": "unresolved_reference", "action_id": action_id,
            "message": f"{u.text} in action {action_id!r} was left as written: {u.reason}"})
            for u in unresolved])
    # what its success sends ahead, made ready now: not on the path from its end to theirs
    ready_ahead = _ahead(job_id, foreseen, trigger, delivery)
    started = time.time()
    with tracing.action_span(job_id, spec, attempt) as span, \
            fencing.holding(job_id, action_id, attempt) as held:
        held.on_stale(partial(_stop_sandboxes, threading.get_ident()))
        status, value, error = _run(job_id, action_id, spec, params, timeout, attempt)
        tracing.outcome(span, status, error)
    finished = time.time()
    if status == "deferred":  # a child job will record the outcome, unless time runs out
        if spec.get("timeout"):
            dispatch.deferred_timeout(job_id, action_id, countdown=float(spec["timeout"]))
        return status

    try:
        if status != "ok" and attempt <= int(spec.get("retry") or 0):
            if store.retry(job_id, action_id, {"action_id": action_id, "attempt": attempt,
                                               "status": status, "error": error},
                           attempt=attempt, holder=owner()):
                time.sleep(min(0.1 * 2 ** (attempt - 1), 5.0))
                return execute(job_id, action_id, spec, trigger, delivery)
            return "stop"
        now = time.time()  # the end is known: the events' time, before anything is sent
        return _record(store, job_id, action_id, spec, trigger, status, value, error, attempt,
                       started, finished, holder=owner(),
                       ahead=ready_ahead if status == "ok" else ([], None), now=now)
    except Fenced as exc:  # another attempt holds it now: this one's outcome is dropped
        fencing.refused(exc)
        return "stale"


def _ahead(job_id: str, foreseen: list[dict[str, Any]], trigger: bool,
           delivery: Delivery) -> Ahead:
    """The messages to send while the action's finish is on its way (if it succeeds): its
    foreseen dependents that take no slot (readiness), or its chain's next step (canvas)."""
    if not foreseen:
        return [], None
    if trigger:
        return dispatch.ahead(job_id, [d for d in foreseen if not gates(job_id, d)])
    if delivery.forward is not None:
        return delivery.forward(foreseen)
    return [], None


def _stop_sandboxes(thread: int) -> None:
    """A stale attempt stops at once: the sandboxed processes and containers its thread runs
    are killed (its outcome would be refused anyway). Each sandbox module is loaded once it
    runs one (never in the API process): one not loaded has nothing to kill."""
    process = sys.modules.get("cortex_worker.sandbox.process")
    if process is not None:
        process.kill_groups_of(thread)
    docker = sys.modules.get("cortex_worker.sandbox.docker")
    if docker is not None:
        docker.kill_containers_of(thread)


def _run(job_id: str, action_id: str, spec: Mapping[str, Any], params: Any,
         timeout: float, attempt: int = 1) -> tuple[str, Any, str | None]:
    """Run the action's target; returns (status, value, error) and never raises."""
    try:
        if spec["type"] not in ACTION_TYPES:
            raise ToolError(f"{spec['type']} actions cannot run in this version")
        value = runner_of(spec["type"])(Call(job_id, action_id, spec, params, timeout,
                                                get_settings(), attempt))
        return "ok", value, None
    except Deferred as deferred:  # the action goes on in a child job
        try:
            _jobs().start_child(get_store(), job_id, action_id, deferred.child)
        except SubmitError as exc:
            return "error", None, exc.message
        return "deferred", None, None
    except ToolTimeout as exc:
        return "timeout", None, str(exc)
    except ModelError as exc:
        return "error", None, f"model error: {exc}"
    except ToolError as exc:
        return "error", None, str(exc)
    except Exception as exc:  # a bug in a tool must not take the worker down
        log.exception("action %s of job %s crashed", action_id, job_id)
        return "error", None, f"{type(exc).__name__}: {exc}"


def invoke(job_id: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run a target outside any plan: `{"value": ...}` or `{"error": "..."}`, never raises."""
    status, value, error = _run(job_id, spec["id"], spec, spec.get("parameters", {}), timeout)
    if status == "ok":
        return {"value": value}
    return {"error": error or f"{spec['type']} {spec['name']!r} cannot run here ({status})"}


def record_outcome(store: Store, job_id: str, action_id: str, spec: Mapping[str, Any],
                   status: str, value: Any, error: str | None, *, trigger: bool = True,
                   attempt: int = 1, started: float | None = None,
                   finished: float | None = None, fence: int | None = None) -> str:
    """Record an action's end (once), send what it made ready, and act on a drained job.
    `fence`: the recording turn's (Fenced if it is stale)."""
    now = time.time()
    return _record(store, job_id, action_id, spec, trigger, status, value, error, attempt,
                   started or now, finished or now, fence=fence)


def _record(store: Store, job_id: str, action_id: str, spec: Mapping[str, Any], trigger: bool,
            status: str, value: Any, error: str | None, attempt: int, started: float,
            finished: float, *, holder: str = "", fence: int | None = None,
            ahead: Ahead = ([], None), now: float | None = None) -> str:
    """Record the outcome; with `holder`, only while `attempt` is current (fencing).
    `ahead`: the dependents sent while the finish is on its way, and how (`Store.finish`);
    `now`: when the end was known."""
    limit = get_settings().max_output_bytes
    truncated = False
    if status == "ok":
        text = dumps(value)
        if len(text.encode()) > limit:
            cut = text.encode()[:limit].decode(errors="ignore")
            value = f"{cut}…[truncated: {len(text.encode()) - limit} more bytes]"
            truncated = True
    duration_ms = round((finished - started) * 1000, 3)
    record = {"status": status, "started_at": started, "finished_at": finished,
              "duration_ms": duration_ms, "attempt": attempt}
    data: dict[str, Any] = {"action_id": action_id, "status": status, "duration_ms": duration_ms}
    if status == "ok":
        record["value"] = data["result"] = value
        if truncated:
            record["truncated"] = data["truncated"] = True
        var, event = value, EventType.action_completed
    else:
        record["error"] = data["error"] = error
        var, event = {"error": error, "status": status}, EventType.action_failed
    result = store.finish(job_id, action_id, status, record, var, spec.get("output_key"),
                          (event, data), attempt=attempt if holder else None, holder=holder,
                          fence=fence, ahead=ahead[0], send_ahead=ahead[1], now=now)
    if not result.recorded:
        return "duplicate"
    if status != "ok":
        job = store.peek(job_id, "options")
        if job is not None and job.options.fail_fast:
            _jobs().fail(store, job_id, f"fail_fast: action {action_id!r} ended {status}: {error}")
            return status
    if trigger and result.ready:
        dispatch.send(job_id, result.ready)
    elif result.ready:  # a canvas step: the chain's next step, sent next, takes its spec
        canvas.hand_on(job_id, result.ready)
    if result.drained:
        _jobs().drained(store, job_id)
    return status
