"""A worker process's steps (`cortex_worker.worker.steps`): the one place that says what each
worker process runs, started in order and stopped in reverse, driven by Celery's signals that
`cortex_worker.worker.signals` alone connects."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import signals as celery_signals

import cortex_worker.tasks  # noqa: F401 (a worker imports it: it connects the signals)
from cortex_worker.services.pool import Instance, ServicePool, ServicePools
from cortex_worker.services.relics.spec import RelicSpec
from cortex_worker.worker import signals, steps
from cortex_worker.worker.process import Process, ProcessContext, Step

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
CONNECTED = ("worker_init", "worker_process_init", "worker_shutting_down", "worker_shutdown",
             "worker_process_shutdown", "before_task_publish", "task_prerun", "task_postrun")


@dataclass
class Recording(Step):
    """A step that writes its hooks' calls to a shared log."""

    label: str
    log: list[tuple[str, str, ProcessContext]]
    fail_at: set[str] = field(default_factory=set)
    name = "recording"

    def _record(self, hook: str, ctx: ProcessContext) -> None:
        self.log.append((hook, self.label, ctx))
        if hook in self.fail_at:
            raise RuntimeError(f"{self.label} failed at {hook}")

    def start(self, ctx: ProcessContext) -> None:
        self._record("start", ctx)

    def shutting_down(self, ctx: ProcessContext) -> None:
        self._record("shutting_down", ctx)

    def stop(self, ctx: ProcessContext) -> None:
        self._record("stop", ctx)


def hooks(log: list[tuple[str, str, ProcessContext]]) -> list[tuple[str, str]]:
    return [(hook, label) for hook, label, _ in log]


def imports_celery_signals(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module == "celery.signals" or (
                node.module == "celery" and any(a.name == "signals" for a in node.names))):
            return True
        if isinstance(node, ast.Import) and any(a.name == "celery.signals" for a in node.names):
            return True
    return False


def test_only_the_signals_module_touches_celerys_signals() -> None:
    users = sorted(str(path.relative_to(REPO_ROOT))
                   for package in ("cortex_worker", "cortex_api")
                   for path in (REPO_ROOT / package).rglob("*.py") if imports_celery_signals(path))
    assert users == ["cortex_worker/worker/signals.py"]


def _ours(name: str) -> list[str]:
    return [str(key[0]) for key, _ in getattr(celery_signals, name).receivers
            if str(key[0]).startswith(signals.PREFIX)]


def test_each_signal_is_connected_once_even_if_connected_again() -> None:
    """Each of our receivers is connected once (by its dispatch uid), however often the
    process connects them: `cortex worker` also keeps the exit code on `worker_shutdown`."""
    signals.connect_process(steps.PROCESS)
    signals.connect_messages()
    signals.connect_exit_code()
    before = {name: _ours(name) for name in CONNECTED}
    signals.connect_process(steps.PROCESS)
    signals.connect_messages()
    signals.connect_exit_code()
    for name in CONNECTED:
        assert _ours(name) == before[name], name
        assert len(set(before[name])) == len(before[name]) >= 1, name
    assert sorted(before["worker_shutdown"]) == ["cortex.exit-code", "cortex.stop"]


def test_the_steps_start_in_order_and_stop_in_reverse() -> None:
    log: list[tuple[str, str, ProcessContext]] = []
    process = Process([Recording("a", log), Recording("b", log), Recording("c", log)],
                      pid=lambda: 7)
    ctx = ProcessContext("main", threaded=True, concurrency=4, queues=frozenset({"agent"}))
    process.start(ctx)
    process.shutting_down()
    process.stop()
    process.stop()  # already stopped: nothing more
    assert hooks(log) == [("start", "a"), ("start", "b"), ("start", "c"),
                          ("shutting_down", "c"), ("shutting_down", "b"), ("shutting_down", "a"),
                          ("stop", "c"), ("stop", "b"), ("stop", "a")]
    assert {c for _, _, c in log} == {ctx}


def test_only_the_steps_that_started_are_stopped_and_a_failed_stop_stops_no_other() -> None:
    log: list[tuple[str, str, ProcessContext]] = []
    process = Process([Recording("a", log, {"stop"}), Recording("b", log),
                       Recording("c", log, {"start"}), Recording("d", log)], pid=lambda: 7)
    with pytest.raises(RuntimeError, match="c failed at start"):
        process.start(ProcessContext("child"))
    process.stop()
    assert hooks(log) == [("start", "a"), ("start", "b"), ("start", "c"),
                          ("stop", "b"), ("stop", "a")]


def test_a_forked_child_runs_its_own_steps_and_a_second_start_is_ignored() -> None:
    log: list[tuple[str, str, ProcessContext]] = []
    pid = [1]
    process = Process([Recording("a", log), Recording("b", log)], pid=lambda: pid[0])
    process.start(ProcessContext("main"))
    process.start(ProcessContext("child"))  # the same process announced twice (a solo pool)
    pid[0] = 2  # forked: the child inherits the record of its parent's steps
    process.stop()  # nothing started in this process yet
    process.start(ProcessContext("child"))
    process.stop()
    assert [(hook, label, ctx.role) for hook, label, ctx in log] == [
        ("start", "a", "main"), ("start", "b", "main"),
        ("start", "a", "child"), ("start", "b", "child"),
        ("stop", "b", "child"), ("stop", "a", "child")]


class FakeWorker:
    """What `worker_init` sends: Celery's WorkController, as far as the steps read it."""

    def __init__(self, pool_cls: str, concurrency: int, queues: set[str]) -> None:
        self.pool_cls, self.concurrency = pool_cls, concurrency
        amqp = SimpleNamespace(queues=SimpleNamespace(consume_from=dict.fromkeys(queues)))
        self.app = SimpleNamespace(amqp=amqp)


def test_celerys_signals_drive_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[str, str, ProcessContext]] = []
    monkeypatch.setattr(steps.PROCESS, "steps", (Recording("a", log), Recording("b", log)))
    monkeypatch.setattr(steps.PROCESS, "_started_in", None)
    monkeypatch.setattr(steps.PROCESS, "_started", [])
    worker = FakeWorker("celery.concurrency.thread:TaskPool", 8, {"agent"})
    celery_signals.worker_init.send(sender=worker)
    celery_signals.worker_process_init.send(sender="host")  # the same process: ignored
    celery_signals.worker_shutting_down.send(sender="host", sig="SIGTERM", how="Warm",
                                             exitcode=0)
    celery_signals.worker_shutdown.send(sender=worker)
    assert hooks(log) == [("start", "a"), ("start", "b"), ("shutting_down", "b"),
                          ("shutting_down", "a"), ("stop", "b"), ("stop", "a")]
    assert log[0][2] == ProcessContext("main", threaded=True, concurrency=8,
                                       queues=frozenset({"agent"}))


def test_what_each_step_does_depends_on_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int | None]] = []
    monkeypatch.setattr(steps.waiting, "wait_in_place", lambda n: calls.append(("wait", n)))
    monkeypatch.setattr(steps.waiting, "stop_waiting", lambda: calls.append(("stop", None)))
    monkeypatch.setattr(steps, "install_sigterm_handler", lambda: calls.append(("sigterm", None)))
    agent, tool = frozenset({"agent"}), frozenset({"tool"})
    for ctx in (ProcessContext("child"), ProcessContext("main", False, 4, agent),
                ProcessContext("main", True, 4, tool), ProcessContext("main", True, 6, agent)):
        steps.SandboxGroups().start(ctx)
        steps.TurnWaits().start(ctx)
    steps.TurnWaits().shutting_down(ProcessContext("main"))
    # the sigterm handler only in a prefork child; waits in place only in a threaded agent
    # worker's own process
    assert calls == [("sigterm", None), ("wait", 6), ("stop", None)]


class Remote(ServicePool[RelicSpec, Instance[RelicSpec]]):
    """A pool of services that run elsewhere: nothing is started here."""

    kind = "remote"

    def _start(self, spec: RelicSpec) -> Instance[RelicSpec]:
        return Instance(spec, None, self.root / "remote.log", 0, self._pid_file(spec.name))

    def _health(self, inst: Instance[RelicSpec]) -> str | None:
        return None


def test_the_services_step_stops_every_pool_of_the_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pools = ServicePools()
    monkeypatch.setattr(steps, "service_pools", lambda: pools)
    pool = pools.get(Remote, tmp_path)
    assert pools.get(Remote, tmp_path / "other") is pool  # one pool per kind and process
    spec = RelicSpec.model_validate({"name": "far", "runtime": "http", "command": ["serve"],
                                     "operations": {"ping": {"path": "/ping"}}})
    pool.release(pool.acquire(spec))
    assert pool.running() == {"far": 0}
    steps.Services().stop(ProcessContext("main"))
    assert pool.running() == {}
