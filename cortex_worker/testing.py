"""A stub broker: the engine's messages run in this process, for fast tests without workers.

Like Dramatiq's `StubBroker`: install it instead of Celery's broker, do what the test is
about, then `join()` runs every message the engine sent, in order, until none is left. The
state still lives in Redis (the Lua scripts are the engine), so a test needs a Redis server
and a `Store` on it, and this process's settings, store and manifests (`cortex_worker.handles`)
pointing at them; but no Celery worker, and no broker connection.

    from cortex_worker.actions import dispatch
    from cortex_worker.jobs import lifecycle as jobs
    from cortex_worker.testing import StubBroker

    broker = StubBroker()
    with dispatch.use_broker(broker):
        job_id = jobs.submit_document(store, text)
        broker.join()  # the start, each action, what they send in turn ...
    assert store.peek(job_id, "status").status == "completed"

How each message runs:

- a task message (`send_task`): the task registered under its name in the Celery app
  (`cortex_worker.tasks`) is called directly, `task.run(*args)`, in this thread. An exception
  it raises propagates out of `join` (the message is then gone, as a failed task's is);
- a canvas (`apply_canvas`): `signature.apply()`, Celery's eager mode, which runs a chain,
  group or chord in place, each step after the one it waits for, without a broker. The
  messages its steps send are queued here as usual;
- a message with a `countdown` waits until every message without one has run: then the one
  that falls due first runs (the stub's clock, `clock`, moves to its time; time itself does
  not pass, nothing sleeps). A periodic feed's refresh schedules itself forever: `join` stops
  with `StubBrokerError` after `max_messages`, or leaves them queued with `delayed=False`;
- `revoke`: queued messages with those task ids are dropped (a message sent after the revoke
  is not; nothing here runs while a revoke is made, so nothing is terminated);
- `invoke` (a context feed's source run on its pool) waits for the task's value: `get()` of
  the handle `send_task` returned runs the message at once.

To simulate a lost message, `drop` takes it from its queue; `sent` keeps every message ever
sent, for assertions about what the engine asked for.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, states
from celery.result import EagerResult

from cortex_worker.errors import CortexError

#: The `name` of a message sent with `apply_canvas`.
CANVAS = "canvas"


class StubBrokerError(CortexError, RuntimeError):
    """A message cannot run here, or `join` never ran out of messages."""


@dataclass(eq=False)
class Message:
    """One message sent through the stub."""

    name: str  # the task's name (`CANVAS` for a canvas)
    args: list[Any]
    queue: str
    task_id: str | None = None
    countdown: float | None = None
    argsrepr: str | None = None
    priority: int | None = None  # its job's (None: 0); the stub runs messages as sent
    signature: Any = None  # the canvas, for `apply_canvas`
    seq: int = 0  # the order it was sent in
    due: float = 0.0  # on the stub's clock
    state: str = "queued"  # then: done, failed, dropped or revoked
    value: Any = None  # what the task returned
    error: BaseException | None = None

    @property
    def delayed(self) -> bool:
        return bool(self.countdown and self.countdown > 0)

    def __repr__(self) -> str:
        args = self.argsrepr or repr(self.args)
        return f"<Message #{self.seq} {self.name}{args} queue={self.queue} {self.state}>"


@dataclass(eq=False)
class StubResult:
    """What `send_task` returns: `get()` runs the message now if it is still queued (as a
    worker would while the sender waits) and returns the task's value."""

    broker: StubBroker
    message: Message
    id: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.message.task_id

    def get(self, timeout: float | None = None, propagate: bool = True,
            disable_sync_subtasks: bool = True, **_: Any) -> Any:
        if self.message.state == "queued":
            self.broker.run(self.message)
        if self.message.state == "failed" and propagate:
            assert self.message.error is not None
            raise self.message.error
        if self.message.state in ("dropped", "revoked"):
            raise StubBrokerError(f"{self.message!r} never ran: it was {self.message.state}")
        return self.message.value

    def forget(self) -> None:
        return None


class StubBroker:
    """Records the engine's messages per queue and runs them in-process (`join`, `step`).
    Implements `cortex_worker.actions.dispatch.Broker`; install it with `dispatch.use_broker`."""

    def __init__(self, app: Celery | None = None) -> None:
        if app is None:
            from cortex_worker.app import app as default_app

            app = default_app
        self.app = app
        self.pending: list[Message] = []  # queued, in the order they were sent
        self.sent: list[Message] = []  # every message ever sent
        self.ran: list[Message] = []  # those run, in the order they ran
        self.revoked: list[str] = []  # every task id revoked
        self.clock = 0.0  # seconds of countdown that have "passed"
        self._seq = itertools.count(1)
        self._lock = threading.RLock()

    # -- the Broker interface ----------------------------------------------------------------
    def send_task(self, name: str, args: Sequence[Any], *, queue: str,
                  task_id: str | None = None, countdown: float | None = None,
                  argsrepr: str | None = None, priority: int | None = None) -> StubResult:
        message = Message(name, list(args), queue, task_id, countdown, argsrepr,
                          priority=priority)
        return StubResult(self, self._put(message))

    def apply_canvas(self, signature: Any) -> Message:
        return self._put(Message(CANVAS, [], _first_queue(signature), signature=signature,
                                 argsrepr=f"({signature!r})"))

    def held(self, delivered_since: float = 0.0) -> set[str]:
        """The task ids of the messages queued here (nothing is delivered and unacknowledged
        in the stub)."""
        with self._lock:
            return {m.task_id for m in self.pending if m.task_id}

    def revoke(self, task_ids: Sequence[str]) -> None:
        ids = set(task_ids)
        with self._lock:
            self.revoked.extend(task_ids)
            for message in [m for m in self.pending if m.task_id in ids]:
                self.pending.remove(message)
                message.state = "revoked"

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        yield

    # -- looking ------------------------------------------------------------------------------
    @property
    def queues(self) -> dict[str, list[Message]]:
        """The queued messages by queue name, each in the order sent."""
        out: dict[str, list[Message]] = {}
        with self._lock:
            for message in self.pending:
                out.setdefault(message.queue, []).append(message)
        return out

    def messages(self, name: str | None = None, *, queue: str | None = None,
                 task_id: str | None = None, sent: bool = False) -> list[Message]:
        """The queued messages (`sent`: every one ever sent) that match, in the order sent."""
        with self._lock:
            source = list(self.sent if sent else self.pending)
        return [m for m in source if (name is None or m.name == name)
                and (queue is None or m.queue == queue)
                and (task_id is None or m.task_id == task_id)]

    # -- running ------------------------------------------------------------------------------
    def next_message(self) -> Message | None:
        """The message `step` would run: the first sent of those without a countdown, else
        the delayed one that falls due first."""
        with self._lock:
            now = [m for m in self.pending if not m.delayed]
            if now:
                return now[0]
            return min(self.pending, key=lambda m: (m.due, m.seq), default=None)

    def step(self) -> Message | None:
        """Run the next message (see `next_message`); None if none is queued."""
        message = self.next_message()
        if message is not None:
            self.run(message)
        return message

    def join(self, *, delayed: bool = True, max_messages: int = 2000) -> int:
        """Run messages until none is left (`delayed=False`: none without a countdown);
        returns how many ran. An exception of a task propagates; more than `max_messages`
        raises `StubBrokerError` (a message that always sends another, such as a periodic
        feed's refresh)."""
        count = 0
        while True:
            message = self.next_message()
            if message is None or (message.delayed and not delayed):
                return count
            if count >= max_messages:
                raise StubBrokerError(f"still sending messages after {count}; next: {message!r}")
            self.run(message)
            count += 1

    def run(self, message: Message) -> Any:
        """Take `message` off its queue and run it in this thread; returns the task's value."""
        with self._lock:
            if message not in self.pending:
                raise StubBrokerError(f"{message!r} is not queued")
            self.pending.remove(message)
            if message.delayed:
                self.clock = max(self.clock, message.due)
            message.state = "running"
        try:
            if message.signature is not None:
                result = message.signature.apply()
                _raise_failure(result)
                message.value = result
            else:
                message.value = self._task(message.name).run(*message.args)
        except BaseException as exc:
            message.state, message.error = "failed", exc
            raise
        finally:
            self.ran.append(message)
        message.state = "done"
        return message.value

    def drop(self, name: str | None = None, *, queue: str | None = None,
             task_id: str | None = None,
             where: Callable[[Message], bool] | None = None) -> list[Message]:
        """Take the queued messages that match off their queues, unrun (a lost message)."""
        with self._lock:
            gone = [m for m in self.messages(name, queue=queue, task_id=task_id)
                    if where is None or where(m)]
            for message in gone:
                self.pending.remove(message)
                message.state = "dropped"
        return gone

    def flush(self) -> list[Message]:
        """Drop every queued message."""
        return self.drop()

    # -- internals -------------------------------------------------------------------------
    def _put(self, message: Message) -> Message:
        with self._lock:
            message.seq = next(self._seq)
            message.due = self.clock + (message.countdown or 0.0)
            self.pending.append(message)
            self.sent.append(message)
        return message

    def _task(self, name: str) -> Any:
        import cortex_worker.tasks  # noqa: F401  (registers the tasks in the app)

        try:
            return self.app.tasks[name]
        except KeyError:
            raise StubBrokerError(f"no task named {name!r} in the Celery app") from None


def _first_queue(signature: Any) -> str:
    """The queue of a canvas's first task (where Celery sends its first message)."""
    while True:
        tasks = getattr(signature, "tasks", None)
        if tasks is None:
            return str(signature.options.get("queue") or "")
        if not tasks:
            return ""
        signature = tasks[0]


def _raise_failure(result: Any) -> None:
    """Raise the error of the first task of an eager canvas run that failed (Celery keeps it
    in the task's result: a chain stops there, a group's other members still run)."""
    todo = [result]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        if isinstance(node, EagerResult) and node.state == states.FAILURE:
            raise node.result
        todo.extend(getattr(node, "results", None) or ())
        todo.append(getattr(node, "parent", None))
