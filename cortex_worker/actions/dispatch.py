"""Sending work to the pools: one action task per ready action, or one canvas per plan.

Every message goes through the process's `Broker`: Celery's (`CeleryBroker`) unless
`use_broker` swapped in another, such as `cortex_worker.testing.StubBroker`, which runs the
engine in-process for tests.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, Protocol

from celery import Celery

from cortex_worker.actions import fairness, table
from cortex_worker.app import app
from cortex_worker.handles import get_registry, get_store
from cortex_worker.jobs import approvals
from cortex_worker.plan.canvas import Step, to_canvas
from cortex_worker.pools import NAMES, broker_lists
from cortex_worker.settings import get_settings

#: Both dispatch paths run actions through this task: readiness sends (job id, action id,
#: spec, True), a canvas step (job id, action id) only.
ACTION_TASK = "cortex.action"
START_TASK = "cortex.start_job"
TURN_TASK = "cortex.agent_turn"
INVOKE_TASK = "cortex.invoke"
FEED_TASK = "cortex.feed_refresh"
DEFERRED_TASK = "cortex.deferred_timeout"
#: The tasks whose return value a sender waits for. Every other task is sent with
#: `ignore_result`: outside a worker (the API) Celery would subscribe to its result channel
#: at each send, a round trip and a subscription held until the handle is collected.
RESULT_TASKS = frozenset({INVOKE_TASK})


class Broker(Protocol):
    """Where the engine's messages go. `CeleryBroker` is the default; a test installs another
    with `use_broker` (see `cortex_worker.testing.StubBroker`)."""

    def send_task(self, name: str, args: Sequence[Any], *, queue: str,
                  task_id: str | None = None, countdown: float | None = None,
                  argsrepr: str | None = None, priority: int | None = None) -> Any:
        """Send one task message to `queue` (run it in `countdown` seconds, if given; behind
        the queue's messages of a lower `priority`, 0 or None first). Returns
        a handle of its result: `get(timeout=..., disable_sync_subtasks=...)` waits for the
        task's return value and `forget()` drops it (only `invoke` uses them)."""
        ...

    def apply_canvas(self, signature: Any) -> Any:
        """Send a Celery canvas (a chain, group or chord of task signatures, or one)."""
        ...

    def revoke(self, task_ids: Sequence[str]) -> None:
        """The queued tasks of these ids never start; those running are terminated."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """Several `send_task` calls in a row (Celery's: through one producer)."""
        ...

    def held(self, delivered_since: float) -> set[str] | None:
        """The task ids of the messages the broker holds: queued, or delivered to a worker
        at or after `delivered_since` (time.time()) and not acknowledged yet (one delivered
        before may be held by a worker that died). None if it cannot tell."""
        ...


class CeleryBroker:
    """The broker of a Celery app: messages go to Redis, and the pools' workers run them."""

    def __init__(self, celery: Celery) -> None:
        self.app = celery
        self._local = threading.local()  # the producer of a `batch` in this thread

    @contextmanager
    def batch(self) -> Iterator[None]:
        if getattr(self._local, "producer", None) is not None:
            yield  # nested: the outer batch's producer serves
            return
        with self.app.producer_or_acquire() as producer:
            self._local.producer = producer
            try:
                yield
            finally:
                self._local.producer = None

    def send_task(self, name: str, args: Sequence[Any], *, queue: str,
                  task_id: str | None = None, countdown: float | None = None,
                  argsrepr: str | None = None, priority: int | None = None) -> Any:
        return self.app.send_task(name, args=list(args), queue=queue, task_id=task_id,
                                  countdown=countdown, argsrepr=argsrepr, priority=priority,
                                  ignore_result=name not in RESULT_TASKS,
                                  producer=getattr(self._local, "producer", None))

    def apply_canvas(self, signature: Any) -> Any:
        return signature.apply_async()

    def revoke(self, task_ids: Sequence[str]) -> None:
        self.app.control.revoke(list(task_ids), terminate=True, signal="SIGTERM")

    def held(self, delivered_since: float) -> set[str] | None:
        """Read from kombu's Redis transport: every lane's list, and its `unacked` hash of
        messages delivered to workers, with their delivery times (`unacked_index`). None on
        another transport, or when the lanes hold too many to read in one pass
        (`HOLDING_SCAN_MAX`)."""
        with self.app.connection_for_read() as connection:
            if connection.transport.driver_type != "redis":
                return None
            client = connection.default_channel.client
            queues = [name for pool in NAMES for name in broker_lists(pool)]
            pipe = client.pipeline(transaction=False)
            for queue in queues:
                pipe.llen(queue)
            sizes = pipe.execute()
            if sum(sizes) > HOLDING_SCAN_MAX:
                return None
            pipe = client.pipeline(transaction=False)
            for queue, size in zip(queues, sizes, strict=True):
                if size:
                    pipe.lrange(queue, 0, -1)
            pipe.zrangebyscore(UNACKED_INDEX_KEY, delivered_since, "+inf")
            *queued, recent = pipe.execute()
            delivered = client.hmget(UNACKED_KEY, recent) if recent else []
        held = {_message_id(raw) for listed in queued for raw in listed}
        for raw in delivered:
            with contextlib.suppress(ValueError, TypeError, IndexError, AttributeError):
                held.add(str(json.loads(raw)[0].get("headers", {}).get("id")))
        return held


HOLDING_SCAN_MAX = 50_000
"""Messages queued in all lanes past which `CeleryBroker.holding` does not read them (a
lost message is then sent again once the backlog is shorter)."""
UNACKED_KEY = "unacked"
"""kombu's Redis hash of delivered, unacknowledged messages (its default `unacked_key`)."""
UNACKED_INDEX_KEY = "unacked_index"
"""kombu's sorted set of those messages' delivery tags, by delivery time."""


def _message_id(raw: Any) -> str:
    """The task id of a message as kombu's Redis transport lists it (JSON: headers.id)."""
    try:
        return str(json.loads(raw).get("headers", {}).get("id"))
    except (ValueError, TypeError, AttributeError):
        return ""


class _Sending:
    """The broker this process sends through now (`use_broker` swaps it)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker


_sending = _Sending(CeleryBroker(app))


def current_broker() -> Broker:
    """The broker dispatch sends through now."""
    return _sending.broker


@contextmanager
def use_broker(broker: Broker) -> Iterator[Broker]:
    """Send every message of this process through `broker` within the block (any thread),
    then through the one before it again."""
    previous, _sending.broker = _sending.broker, broker
    try:
        yield broker
    finally:
        _sending.broker = previous


def task_id(job_id: str, action_id: str) -> str:
    """Deterministic Celery task id of an action, so it can be revoked by name."""
    return f"{job_id}:{action_id}"


def route_of(job_id: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Where an action's message goes: its pool (the action-type table's route), in the lane
    of its job's tenant, at its job's priority (`fairness.route`)."""
    return fairness.route(table.queue_of(get_registry(), spec), job_id)


def _options(job_id: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    return {**route_of(job_id, spec), "task_id": task_id(job_id, spec["id"]),
            "argsrepr": f"({job_id!r}, {spec['id']!r}, {spec['name']!r})"}


def send(job_id: str, specs: Iterable[Mapping[str, Any]], countdown: float | None = None) -> None:
    """Send one task per action (readiness dispatch); one that needs a person's approval is
    held until it has it (`approvals.hold`)."""
    specs = list(specs)
    if not specs:
        return
    _send(job_id, approvals.hold(get_store(), job_id, specs, get_registry(), get_settings()),
          countdown=countdown)


def ahead(job_id: str, specs: Iterable[Mapping[str, Any]]
          ) -> tuple[list[str], Callable[[], None] | None]:
    """The actions a running action's success will make ready, to send while its finish is on
    its way to Redis (its claim foresaw them: executor.py): their ids, and what sends them.
    One that may wait for a person does not go ahead (asking for it would come before the
    end it waits for); its finish sends it. Each message says it went ahead: one that still
    comes before that finish is dropped, and the finish sends it again (lua/claim.lua)."""
    registry = get_registry()
    specs = [s for s in specs if not approvals.waits_for_person(s, registry)]
    if not specs:
        return [], None
    messages = [_message(job_id, spec, ahead=True) for spec in specs]
    return [spec["id"] for spec in specs], partial(_publish, messages)


def _send(job_id: str, specs: Sequence[Mapping[str, Any]], *,
          countdown: float | None = None) -> None:
    _publish([_message(job_id, spec) for spec in specs], countdown=countdown)


def _message(job_id: str, spec: Mapping[str, Any], *, ahead: bool = False
             ) -> tuple[list[Any], dict[str, Any]]:
    """A readiness task's (args, options): the action's spec, `trigger`, and whether it goes
    ahead of its dependency's finish."""
    args = [job_id, spec["id"], dict(spec), True]
    return ([*args, True] if ahead else args), _options(job_id, spec)


def _publish(messages: Sequence[tuple[list[Any], dict[str, Any]]], *,
             countdown: float | None = None) -> None:
    """Send action tasks: (args, options) each."""
    if not messages:
        return
    broker = _sending.broker
    with broker.batch():
        for args, options in messages:
            broker.send_task(ACTION_TASK, args, countdown=countdown, **options)


def send_canvas(job_id: str, step: Step, specs: Mapping[str, Mapping[str, Any]]) -> None:
    """Send a whole series-parallel plan as one canvas mirroring its structure."""
    def signature(action_id: str) -> Any:
        # Small: a chain's message carries every later step. Only the ids (plan/canvas.py:
        # each run of steps travels as its ids), no argsrepr (the args are the ids already), and an empty reply_to, which
        # Celery would otherwise fill with a 36-character id per step that no Cortex result
        # backend reads.
        return app.signature(ACTION_TASK, args=[job_id, action_id], immutable=True,
                             **route_of(job_id, specs[action_id]),
                             task_id=task_id(job_id, action_id),
                             reply_to="")

    _sending.broker.apply_canvas(to_canvas(step, signature))


def start_job(job_id: str, countdown: float | None = None) -> None:
    """Queue the start of a job on the agent pool (in `countdown` seconds, if given)."""
    _sending.broker.send_task(START_TASK, [job_id], **fairness.route("agent", job_id),
                              task_id=f"{job_id}:start", countdown=countdown)


def agent_turn(job_id: str, countdown: float | None = None, *, start: bool = False) -> None:
    """Queue an agent job's next turn on the agent pool (in `countdown` seconds, if given).
    `start`: it is the job's start, sent again (its message has the start's task id, which
    the reconciler looks for before it calls a start lost)."""
    _sending.broker.send_task(TURN_TASK, [job_id], **fairness.route("agent", job_id),
                              countdown=countdown, argsrepr=f"({job_id!r},)",
                              task_id=f"{job_id}:start" if start else None)


def invoke(spec: Mapping[str, Any], *, timeout: float, job_id: str) -> Any:
    """Run one target on its pool outside any plan and wait for its value (context feeds)."""
    result = _sending.broker.send_task(INVOKE_TASK, [job_id, dict(spec), timeout],
                                       **route_of(job_id, spec),
                                       argsrepr=f"({job_id!r}, {spec['id']!r}, {spec['name']!r})")
    try:
        outcome = result.get(timeout=timeout + 5, disable_sync_subtasks=False)
    finally:
        result.forget()
    if "error" in outcome:
        raise RuntimeError(outcome["error"])
    return outcome["value"]


def deferred_timeout(job_id: str, action_id: str, countdown: float) -> None:
    """Check, once the timeout has passed, that a deferred (child-job) action has ended."""
    _sending.broker.send_task(DEFERRED_TASK, [job_id, action_id],
                              **fairness.route("agent", job_id), countdown=countdown,
                              argsrepr=f"({job_id!r}, {action_id!r})")


def refresh_feed(job_id: str, feed_id: str, generation: int, countdown: float) -> None:
    """Schedule a periodic feed's next refresh on the agent pool."""
    _sending.broker.send_task(FEED_TASK, [job_id, feed_id, generation],
                              **fairness.route("agent", job_id), countdown=countdown,
                              argsrepr=f"({job_id!r}, {feed_id!r})")


def refresh_feeds(job_id: str, feeds: Mapping[str, Any],
                  generations: Mapping[str, int] | None = None) -> None:
    """Start the refresh loop of each periodic feed (`FeedSpec`s by id)."""
    for feed_id, feed in feeds.items():
        if feed.type == "periodic" and feed.interval:
            refresh_feed(job_id, feed_id, (generations or {}).get(feed_id, 0), countdown=0)


def revoke(job_id: str, action_ids: Iterable[str]) -> None:
    """Revoke actions: queued ones never start, running ones are terminated."""
    ids = [task_id(job_id, a) for a in action_ids]
    if ids:
        _sending.broker.revoke(ids)
