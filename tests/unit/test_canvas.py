"""Series-parallel plans compile to a canvas that mirrors them; others do not compile. Its
steps are `cortex.action` tasks, and a step whose action is held elsewhere retries itself."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, group, signature
from celery.canvas import Signature
from celery.canvas import _chain as chain
from celery.canvas import _chord as chord

from cortex_worker.actions import dispatch, executor
from cortex_worker.plan.canvas import (
    STEP_RUN,
    CompactChain,
    compact,
    decompose,
    forward,
    hand_on,
    to_canvas,
)
from cortex_worker.plan.dag import build_plan
from cortex_worker.protocol.actions import Action

pytestmark = pytest.mark.unit


def plan(ids: str, edges: dict[str, str]):
    return build_plan([Action(id=i, name="echo", mode="async", depends_on=tuple(edges.get(i, "")))
                       for i in ids])


def canvas(step):
    app = Celery("t", set_as_current=False)
    return to_canvas(step, lambda i: app.signature("cortex.action", args=[i], immutable=True))


def names(sig) -> list:
    """The canvas as nested lists of kinds and action ids."""
    if isinstance(sig, chord):
        return ["chord", [names(t) for t in sig.tasks], names(sig.body)]
    if isinstance(sig, chain):
        return ["chain", *[names(t) for t in sig.tasks]]
    if isinstance(sig, group):
        return ["group", *[names(t) for t in sig.tasks]]
    return sig.args[0]


def test_sequence_is_a_chain():
    step = decompose(plan("abc", {"b": "a", "c": "b"}))
    assert step.shape() == ("chain", ["a", "b", "c"])
    assert names(canvas(step)) == ["chain", "a", "b", "c"]
    assert step.width() == 1


def test_fan_out_is_a_chain_into_a_group():
    step = decompose(plan("abc", {"b": "a", "c": "a"}))
    assert step.shape() == ("chain", ["a", ("group", ["b", "c"])])
    assert names(canvas(step)) == ["chain", "a", ["group", "b", "c"]]


def test_fan_in_is_a_chord():
    step = decompose(plan("abc", {"c": "ab"}))
    assert step.shape() == ("chain", [("group", ["a", "b"]), "c"])
    # Celery turns a group followed by a task into a chord: header a, b; body c.
    assert names(canvas(step)) == ["chord", ["a", "b"], "c"]


def test_diamond_is_chain_group_task():
    step = decompose(plan("abcd", {"b": "a", "c": "a", "d": "bc"}))
    assert step.shape() == ("chain", ["a", ("group", ["b", "c"]), "d"])
    assert step.width() == 2
    assert names(canvas(step)) == ["chain", "a", ["chord", ["b", "c"], "d"]]


def test_nested_series_parallel():
    step = decompose(plan("abcde", {"b": "a", "d": "c", "e": "bd"}))
    assert step.shape() == ("chain", [("group", [("chain", ["a", "b"]), ("chain", ["c", "d"])]), "e"])


def test_independent_actions_are_one_group():
    step = decompose(plan("abcd", {}))
    assert step.shape() == ("group", ["a", "b", "c", "d"])
    assert step.width() == 4


def test_n_shape_is_not_series_parallel():
    # A→C, A→D, B→D: any canvas would make C wait for B; readiness dispatch runs it.
    assert decompose(plan("ABCD", {"C": "A", "D": "AB"})) is None


def test_sync_barrier_edges_count():
    actions = [Action(id="a", name="echo", mode="sync"), Action(id="b", name="echo", mode="async")]
    assert decompose(build_plan(actions)).shape() == ("chain", ["a", "b"])


def test_long_chain_has_no_recursion_limit():
    ids = [f"n{i}" for i in range(3000)]
    actions = [Action(id=i, name="echo", mode="async", depends_on=(ids[k - 1],) if k else ())
               for k, i in enumerate(ids)]
    step = decompose(build_plan(actions))
    assert step.kind == "chain" and len(step.parts) == 3000


def test_plan_with_errors_does_not_compile():
    assert decompose(plan("ab", {"a": "b", "b": "a"})) is None


def test_canvas_steps_are_action_tasks_with_only_the_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    monkeypatch.setattr(dispatch, "route_of",
                        lambda job_id, spec: {"queue": spec["queue"], "priority": None})
    monkeypatch.setattr(dispatch.current_broker(), "apply_canvas", sent.append)
    step = decompose(plan("abc", {"b": "a", "c": "b"}))
    dispatch.send_canvas("j1", step, {i: {"queue": q} for i, q in zip("abc", ["tool", "agent", "tool"], strict=True)})
    steps = sent[0].tasks
    assert [s.task for s in steps] == ["cortex.action"] * 3
    # the ids only (the worker reads the spec, and `trigger` follows from its absence)
    assert [list(s.args) for s in steps] == [["j1", "a"], ["j1", "b"], ["j1", "c"]]
    assert all(s.immutable and not s.kwargs for s in steps)
    assert [s.options for s in steps] == [
        {"queue": q, "priority": None, "task_id": f"j1:{i}", "reply_to": ""}
        for i, q in zip("abc", ["tool", "agent", "tool"], strict=True)]


def step_signature(app: Celery, action_id: str, queue: str = "tool",
                   priority: int | None = None) -> Any:
    """A step as `dispatch.send_canvas` makes it (its route always names a priority)."""
    return app.signature("cortex.action", args=["j1", action_id], immutable=True, queue=queue,
                         priority=priority, task_id=f"j1:{action_id}", reply_to="")


def sent(monkeypatch: pytest.MonkeyPatch, send: Any) -> tuple[Any, list[Any]]:
    """What `send()` publishes: the step sent and its message's `chain` field, as a worker
    reads it back (JSON)."""
    out: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(Signature, "_apply_async",
                        property(lambda self: lambda *a, **options: out.append((self, options))))
    send()
    assert len(out) == 1
    return out[0][0], json.loads(json.dumps(out[0][1].get("chain") or []))


def test_a_chain_message_carries_each_run_of_steps_as_their_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("t", set_as_current=False)
    step = decompose(plan("abcde", {"b": "a", "c": "b", "d": "c", "e": "d"}))
    queues = {"a": "tool", "b": "tool", "c": "tool", "d": "llm", "e": "tool"}
    canvas_ = to_canvas(step, lambda i: step_signature(app, i, queues[i], priority=3))
    assert isinstance(canvas_, CompactChain)
    first, rest = sent(monkeypatch, canvas_.apply_async)
    assert first.args == ("j1", "a")
    run = {"subtask_type": STEP_RUN, "task": "cortex.action", "job": "j1", "priority": 3}
    assert rest == [  # last to first: a worker pops the next entry off the end
        {**run, "ids": ["e"], "queue": "tool"}, {**run, "ids": ["d"], "queue": "llm"},
        {**run, "ids": ["b", "c"], "queue": "tool"}]


def test_a_worker_takes_a_run_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's tracer pops the chain's last entry, makes it a signature and sends it with the
    entries before it: a run sends its first step, and the rest of the run after it."""
    app = Celery("t", set_as_current=False)
    chain_ = [{"subtask_type": "chord"},  # any entry Celery wrote, left as it is
              {"subtask_type": STEP_RUN, "task": "cortex.action", "job": "j1", "ids": ["b", "c"],
               "queue": "tool"}]
    b = signature(chain_[-1], app=app)
    assert (b.task, b.args, b.immutable, b.options) == (
        "cortex.action", ("j1", "b"), True,
        {"queue": "tool", "task_id": "j1:b", "argsrepr": "('j1', 'b')", "kwargsrepr": "{}"})
    _, rest = sent(monkeypatch, lambda: b.apply_async(("ok",), chain=chain_[:-1]))
    assert rest == [chain_[0], {**chain_[1], "ids": ["c"]}]
    c = signature(rest[-1], app=app)
    assert c.args == ("j1", "c")
    _, rest = sent(monkeypatch, lambda: c.apply_async(("ok",), chain=rest[:-1]))
    assert rest == [chain_[0]]  # the run is spent


def test_the_next_step_carries_the_spec_its_predecessor_made_ready() -> None:
    """A step hands on the specs it made ready (`hand_on`): the chain's next step, sent by
    the same thread right after, carries its spec instead of reading it."""
    app = Celery("t", set_as_current=False)
    spec = {"id": "b", "type": "tool", "name": "echo", "parameters": {}}
    hand_on("j1", [spec, {"id": "x", "type": "tool", "name": "echo"}])
    entry = {"subtask_type": STEP_RUN, "task": "cortex.action", "job": "j1", "ids": ["b"],
             "queue": "tool"}
    b = signature(entry, app=app)
    assert b.args == ("j1", "b", spec, False)  # the spec, and no readiness trigger
    assert b.options["task_id"] == "j1:b" and b.options["argsrepr"] == "('j1', 'b')"
    assert signature(entry, app=app).args == ("j1", "b")  # taken once
    hand_on("j1", [])
    assert signature({**entry, "ids": ["x"]}, app=app).args == ("j1", "x")  # only the latest


def test_a_step_sends_its_next_step_ahead_of_its_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """When its claim foresaw the next step's action, a step sends that step itself, as
    Celery's tracer would, with its spec and marked as sent ahead; the tracer then finds no
    chain left to send. Any other next step is left to the tracer, after the finish."""
    app = Celery("t", set_as_current=False)
    spec = {"id": "b", "type": "tool", "name": "echo", "parameters": {}}
    later = {"subtask_type": "chord"}
    entry = {"subtask_type": STEP_RUN, "task": "cortex.action", "job": "j1", "ids": ["b", "c"],
             "queue": "tool"}

    def task(chain_: list[Any]) -> Any:
        request = SimpleNamespace(chain=chain_, id="j1:a", root_id="j1:r", delivery_info={})
        return SimpleNamespace(request=request, app=app)

    waiting = task([later, entry])
    assert forward(waiting, "j1", [{"id": "x"}]) == ([], None)  # b is not foreseen
    assert forward(task([entry, later]), "j1", [spec]) == ([], None)  # not a plain step next
    assert waiting.request.chain == [later, entry]  # untouched: the tracer sends it
    ahead = task([later, entry])
    ids, send = forward(ahead, "j1", [spec])
    assert ids == ["b"] and send is not None
    b, rest = sent(monkeypatch, send)
    assert b.args == ("j1", "b", spec, False, True)  # its spec; no trigger; sent ahead
    assert rest == [later, {**entry, "ids": ["c"]}]
    assert ahead.request.chain is None  # nothing left for the tracer


def test_steps_a_run_cannot_hold_travel_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("t", set_as_current=False, backend="cache+memory://")  # chords need one
    step = decompose(plan("abcde", {"b": "a", "c": "b", "d": "b", "e": "cd"}))
    odd = app.signature("cortex.action", args=["j1", "c"], kwargs={"x": 1}, immutable=True,
                        queue="tool", task_id="j1:c")
    canvas_ = to_canvas(step, lambda i: odd if i == "c" else step_signature(app, i))
    first, rest = sent(monkeypatch, canvas_.apply_async)
    assert first.args == ("j1", "a")
    chord_, b = rest
    assert b["subtask_type"] == STEP_RUN and b["ids"] == ["b"]
    assert chord_["subtask_type"] == "chord"  # c and d, then e: as Celery writes it
    other_id = step_signature(app, "c").set(task_id="elsewhere")
    assert compact([odd, other_id]) == [odd, other_id]


def test_a_compact_step_of_an_earlier_version_still_runs() -> None:
    app = Celery("t", set_as_current=False)
    old = {"subtask_type": "cortex.step", "task": "cortex.action", "args": ["j1", "b"],
           "queue": "tool"}
    b = signature(old, app=app)
    assert (b.task, b.args, b.options["queue"], b.options["task_id"]) == (
        "cortex.action", ("j1", "b"), "tool", "j1:b")


def test_a_compact_chain_runs_as_celery_runs_a_chain_otherwise() -> None:
    app = Celery("t", set_as_current=False)
    ran: list[str] = []

    @app.task(name="step")
    def step_(action_id: str) -> None:
        ran.append(action_id)

    canvas_ = to_canvas(decompose(plan("abc", {"b": "a", "c": "b"})),
                        lambda i: app.signature("step", args=[i], immutable=True))
    assert isinstance(canvas_, CompactChain)
    canvas_.apply()  # eager, as the stub broker runs a canvas
    assert ran == ["a", "b", "c"]


class BusyStore:
    """A store whose `claim` says another delivery holds the action until `until`."""

    def __init__(self, until: float) -> None:
        self.until, self.claims = until, 0

    def spec(self, job_id: str, action_id: str) -> dict[str, Any]:
        return {"id": action_id, "type": "tool", "name": "echo", "timeout": 5, "parameters": {}}

    def claim(self, *args: Any, **kwargs: Any) -> list[str]:
        self.claims += 1
        return ["busy", "elsewhere:1", repr(self.until)]

    def alive(self, owners: Any) -> set[str]:  # the holder's heartbeat is live
        return set(owners)


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> BusyStore:
    store = BusyStore(time.time() + 2.0)
    monkeypatch.setattr(executor, "get_store", lambda: store)

    def no_sleep(seconds: float) -> None:
        raise AssertionError("a worker slot must not wait for another delivery")

    monkeypatch.setattr(executor.time, "sleep", no_sleep)
    return store


class Again(Exception):
    """What `again` raises here (a task raises Celery's Retry)."""


def again_after(countdowns: list[float]) -> Any:
    def again(countdown: float) -> None:
        countdowns.append(countdown)
        raise Again

    return again


def test_busy_canvas_step_asks_to_be_delivered_again(busy: BusyStore,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor.dispatch, "send", lambda *a, **k: pytest.fail("sent a task"))
    countdowns: list[float] = []
    with pytest.raises(Again):
        executor.execute("j1", "a", None, False, executor.Delivery(again=again_after(countdowns)))
    assert busy.claims == 1  # one look, no polling
    # when the holder's lease ends (its 2 s less the time this took: at least the 0.5 s floor)
    assert len(countdowns) == 1 and 0.5 <= countdowns[0] <= 2.0


def test_busy_step_looks_again_at_most_5_s_later(busy: BusyStore) -> None:
    busy.until = time.time() + 600
    countdowns: list[float] = []
    with pytest.raises(Again):
        executor.execute("j1", "a", None, False, executor.Delivery(again=again_after(countdowns)))
    assert countdowns == [5.0]


def test_busy_readiness_task_is_sent_again(busy: BusyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[Any, ...]] = []
    monkeypatch.setattr(executor.dispatch, "send",
                        lambda job_id, specs, countdown=None: sent.append((job_id, specs, countdown)))
    spec = busy.spec("j1", "a")
    assert executor.execute("j1", "a", spec, trigger=True) == "busy"
    assert len(sent) == 1 and sent[0][:2] == ("j1", [spec]) and 1.5 < sent[0][2] <= 2.0


def test_a_busy_canvas_step_task_retries_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from cortex_worker import tasks

    class Retried(Exception):
        pass

    class FakeTask:
        request = SimpleNamespace(retries=0)

        def retry(self, countdown: float) -> Exception:
            self.countdown = countdown
            return Retried()

    calls: list[tuple[Any, ...]] = []

    def busy_execute(job_id: str, action_id: str, spec: Any, trigger: bool,
                     delivery: Any) -> str:
        calls.append((job_id, action_id, spec, trigger, delivery.again))
        if delivery.again is not None:
            delivery.again(1.25)
        return "busy"

    monkeypatch.setattr(tasks.executor, "execute", busy_execute)
    task = FakeTask()
    with pytest.raises(Retried):
        tasks._execute(task, "j1", "a", None, False)  # type: ignore[arg-type]
    assert task.countdown == 1.25
    assert tasks._execute(task, "j1", "a", {"id": "a"}, True) == "busy"  # type: ignore[arg-type]
    assert calls[1][4] is None  # a readiness task sends a new one instead
    assert tasks.run_action.max_retries is None  # however long the other holder takes
    assert tasks.run_action.ignore_result  # no result backend write per step
