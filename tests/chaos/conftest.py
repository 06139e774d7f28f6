"""Chaos tests: kill workers, the coordinator, Redis and the API mid-job, and check that jobs
complete with every result recorded once and every event delivered once.

This suite starts its OWN stack, so it may kill any part of it: a redis-server with an
append-only file (`appendfsync everysec`), one `cortex worker` per pool, the API and the fake
model server. Everything runs with the settings as shipped: the work of a killed process is
found and sent again by Cortex's reconciler (cortex_worker/recovery/reconciler.py), not by the broker's
visibility timeout (6 h). Every test here is marked `integration`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import harness
from tests.fake_llm import FakeLLM, Turn

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
MANIFESTS_DIR = REPO_ROOT / "tests" / "manifests"
POOLS = {"agent": 4, "tool": 2, "llm": 2, "relic": 2}
ENDED = {"completed", "failed", "cancelled"}
TERMINAL_EVENTS = {"job_completed", "job_failed", "job_cancelled"}
FAILURE_LOG_LINES = 40
#: Recovery times measured by the tests, printed at the end of the run (docs/reliability.md).
TIMINGS: dict[str, dict[str, Any]] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.section("chaos timings")
        for scenario, numbers in TIMINGS.items():
            terminalreporter.write_line(f"{scenario}: " + ", ".join(
                f"{k} {v}" for k, v in numbers.items()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failing chaos test, attach the tail of every live harness process's log."""
    report = yield
    if report.failed and Path(str(item.path)).resolve().is_relative_to(HERE):
        procs = harness.live_processes()
        if procs:
            report.sections.append(("harness process logs",
                                    "\n".join(p.describe(FAILURE_LOG_LINES) for p in procs)))
    return report


# ------------------------------------------------------------------------------ the stack


class Stack:
    """Redis (AOF), one worker per pool, the API and the fake model: each can be killed and
    replaced. `workers[pool]` is always the current worker of that pool."""

    def __init__(self, base: Path, llm: FakeLLM) -> None:
        self.dir = base
        self.llm = llm
        self.redis = harness.RedisServer(appendonly=True, log_dir=base, data_dir=base / "redis")
        self.redis.start()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CORTEX_", "CELERY_")) and k != "REDIS_URL"}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
        env["PYTHONUNBUFFERED"] = "1"
        env["_TYPER_STANDARD_TRACEBACK"] = "1"
        env["CORTEX_REDIS_URL"] = self.redis.url
        env["CORTEX_MANIFESTS"] = str(MANIFESTS_DIR)
        env["CORTEX_WORKSPACE_ROOT"] = str(base / "workspaces")
        env["CORTEX_TEST_LLM_URL"] = llm.url
        self.env = env
        self.workers: dict[str, harness.Process] = {}
        self.api: harness.Process | None = None
        self.client = self.redis.client(decode_responses=True)
        self._control: Any = None  # a Celery app for remote control, made on first use

    # -- processes
    def start_workers(self, pools: dict[str, int]) -> None:
        self.workers.update(harness.start_workers(pools, self.env, log_dir=self.dir, cwd=self.dir))

    def start_api(self, port: int | None = None) -> harness.Process:
        self.api = harness.start_api(self.env, port, log_dir=self.dir, cwd=self.dir)
        return self.api

    @property
    def url(self) -> str:
        assert self.api is not None
        return self.api.url or ""

    def kill_worker(self, pool: str) -> float:
        """SIGKILL the pool's worker and its whole process group; returns when it is gone."""
        proc = self.workers[pool]
        proc.kill(signal.SIGKILL)
        assert proc.wait_stopped(10), proc.describe()
        proc.stop()  # unregisters it
        return time.monotonic()

    def replace_worker(self, pool: str) -> harness.Process:
        """Start a new worker for `pool` (after `kill_worker`)."""
        self.workers[pool] = harness.start_worker(pool, self.env, POOLS.get(pool), log_dir=self.dir,
                                                  cwd=self.dir)
        return self.workers[pool]

    def start_spare(self, pool: str) -> harness.Process:
        """Start another worker for `pool` beside `workers[pool]`, with a node name of its own
        (`<pool>-<random>@host`): Celery's remote control (`active_tasks`) then tells the two
        apart, which a second `<pool>@host` would not."""
        name = f"{pool}-{os.urandom(3).hex()}@%h"
        return harness.start_worker(pool, self.env, POOLS.get(pool), log_dir=self.dir,
                                    cwd=self.dir, extra_args=["--hostname", name])

    def active_tasks(self, proc: harness.Process) -> list[dict[str, Any]] | None:
        """The tasks worker `proc` runs now (Celery's `inspect active`), None if it did not
        answer: how a test knows a woken worker has finished whatever it was doing, by what
        the worker says rather than by waiting some time."""
        if self._control is None:
            self._control = harness.celery_control_app(self.env)
        assert proc.worker_hostname is not None, proc
        replies = self._control.control.inspect(destination=[proc.worker_hostname],
                                                timeout=1.0).active() or {}
        return replies.get(proc.worker_hostname)

    def stale_writes(self) -> dict[str, float]:
        """`cortex_stale_writes_total` by `write`, as GET /metrics on the API serves it (the
        writes the store refused from a holder whose lease was taken over: fencing)."""
        response = httpx.get(f"{self.url}/metrics", timeout=30)
        assert response.status_code == 200, response.text
        assert "# TYPE cortex_stale_writes_total counter" in response.text, "no stale-writes metric"
        out: dict[str, float] = {}
        for line in response.text.splitlines():
            if line.startswith("cortex_stale_writes_total{"):
                labels, _, value = line.rpartition(" ")
                out[labels.partition('write="')[2].partition('"')[0]] = float(value)
        return out

    def supervise(self) -> Callable[[], list[str]]:
        """Replace any worker that exits (as systemd or Kubernetes would) until the returned
        function is called; it returns the pools whose worker was replaced."""
        stop = threading.Event()
        replaced: list[str] = []

        def loop() -> None:
            while not stop.wait(0.2):
                for pool, proc in list(self.workers.items()):
                    if not proc.alive:
                        proc.stop()
                        replaced.append(pool)
                        self.replace_worker(pool)

        thread = threading.Thread(target=loop, daemon=True, name="supervisor")
        thread.start()

        def done() -> list[str]:
            stop.set()
            thread.join(60)
            return replaced

        return done

    # -- jobs
    def submit(self, body: dict[str, Any]) -> str:
        response = httpx.post(f"{self.url}/v1/jobs", json=body, timeout=30)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/jobs/{job_id}", timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's whole log, read straight from its Redis stream."""
        entries = self.client.xrange(f"cx:{{{job_id}}}:events")
        return [json.loads(fields["e"]) for _, fields in entries]

    def wait_event(self, job_id: str, predicate: Callable[[dict[str, Any]], bool],
                   timeout: float = 20) -> dict[str, Any]:
        """Poll the log (in Redis) until an event matches; return it."""
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events(job_id) if predicate(e)), None)

        return harness.wait_until(found, timeout=timeout, interval=0.02,
                                  message=lambda: f"no such event in {self.events(job_id)}")

    def wait_ended(self, job_id: str, timeout: float = 40) -> dict[str, Any]:
        def ended() -> dict[str, Any] | None:
            status = self.client.hget(f"cx:{{{job_id}}}:job", "status")
            return self.job(job_id) if status in ENDED else None

        return harness.wait_until(ended, timeout=timeout, interval=0.05,
                                  message=lambda: f"job {job_id} did not end: {self.job(job_id)}")

    def close(self) -> None:
        self.client.close()
        if self._control is not None:
            self._control.close()
        harness.stop_all(processes=[*self.workers.values(), *([self.api] if self.api else [])])
        self.redis.close()


@contextmanager
def paused(proc: harness.Process) -> Iterator[Callable[[], None]]:
    """SIGSTOP `proc`'s process group: from outside it looks dead (no heartbeat, no reads),
    as after a long GC pause, a frozen VM or a network partition, but it has lost nothing and
    goes on where it stopped once woken. Yields `wake` (SIGCONT; idempotent). On leaving, the
    group is woken whatever happened: a stopped process holds SIGTERM until it is continued,
    so a test that left one stopped would hold up every later stop of the stack."""
    woken = False

    def wake() -> None:
        nonlocal woken
        if not woken:
            woken = True
            proc.kill(signal.SIGCONT)

    proc.kill(signal.SIGSTOP)
    try:
        yield wake
    finally:
        wake()


@pytest.fixture(scope="session", autouse=True)
def _harness_session() -> Iterator[None]:
    harness.reap_orphans()
    try:
        yield
    finally:
        harness.stop_all()


class ChaosLLM(FakeLLM):
    """The fake model server, which can also answer a model by a function of each request
    (`answer`) instead of a queue of turns: a turn that is generated again (its coordinator
    died, the turn is replayed) gets the same text, as from a real model at temperature 0.
    Models without such a function are served from their scripted queue as before."""

    def __init__(self) -> None:
        super().__init__()
        self._answers: dict[str, Callable[[dict[str, Any]], Turn]] = {}

    def answer(self, model: str, answer: Callable[[dict[str, Any]], Turn]) -> None:
        """Serve every request for `model` with `answer(request body)`."""
        with self._lock:
            self._answers[model] = answer

    def _record(self, model: str, body: dict[str, Any], headers: dict[str, str]
                ) -> tuple[int, Turn | None]:
        index, turn = super()._record(model, body, headers)
        with self._lock:
            answer = self._answers.get(model)
        return (index, turn) if answer is None else (index, answer(body))


def turn_number(body: dict[str, Any]) -> int:
    """The agent turn a chat request asks for: 1 + its `assistant` messages (as the `replay`
    provider counts them, cortex_worker/llm/replay.py)."""
    return 1 + sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")


@pytest.fixture(scope="session")
def chaos_llm() -> Iterator[ChaosLLM]:
    with ChaosLLM() as server:
        yield server


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, chaos_llm: FakeLLM) -> Iterator[Stack]:
    """The chaos suite's own stack, shared by its tests (each leaves it whole again)."""
    stack = Stack(tmp_path_factory.mktemp("chaos"), chaos_llm)
    try:
        stack.start_workers(POOLS)
        stack.start_api()
        yield stack
    finally:
        stack.close()


# ------------------------------------------------------------------------------ an SSE client


class SSEClient:
    """Follows a job's events in a thread and reconnects with `Last-Event-ID` whenever the
    connection drops or cannot be made (API restarting), until the job's last event.

    `events`: every event received, in order (duplicates kept, so tests can see them);
    `connects`: how many connections were opened; `errors`: why earlier ones ended."""

    def __init__(self, url: str, job_id: str, timeout: float = 60) -> None:
        self.url, self.job_id, self.timeout = url, job_id, timeout
        self.events: list[dict[str, Any]] = []
        self.connects = 0
        self.errors: list[str] = []
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"sse-{job_id[:6]}")
        self._thread.start()

    @property
    def last_seq(self) -> int | None:
        return self.events[-1]["seq"] if self.events else None

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            headers = {} if self.last_seq is None else {"Last-Event-ID": str(self.last_seq)}
            try:
                with httpx.stream("GET", f"{self.url}/v1/jobs/{self.job_id}/events",
                                  headers=headers, timeout=httpx.Timeout(30, connect=2)) as response:
                    self.connects += 1
                    if response.status_code != 200:
                        self.errors.append(f"HTTP {response.status_code}")
                        time.sleep(0.2)
                        continue
                    data: list[str] = []
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            data.append(line[5:].strip())
                        elif line == "" and data:
                            event = json.loads("\n".join(data))
                            data = []
                            self.events.append(event)
                            if event["type"] in TERMINAL_EVENTS:
                                self.done.set()
                                return
                self.errors.append("stream closed before the job's last event")
            except (httpx.HTTPError, OSError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.1)

    def wait(self, timeout: float = 60) -> list[dict[str, Any]]:
        self._thread.join(timeout)
        assert self.done.is_set(), f"SSE client did not see the end: {self.errors[-5:]}"
        return self.events


@pytest.fixture
def sse(stack: Stack) -> Callable[..., SSEClient]:
    return lambda job_id, **kw: SSEClient(stack.url, job_id, **kw)


def assert_exactly_once(events: list[dict[str, Any]], log: list[dict[str, Any]]) -> None:
    """`events` (as a client saw them) are the job's log `log`, each once, seq 1..n."""
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(log) + 1)), seqs
    assert [e["seq"] for e in log] == seqs
    assert [e["type"] for e in events] == [e["type"] for e in log]

