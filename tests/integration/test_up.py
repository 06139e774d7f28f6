"""`cortex up` end to end: the whole stack as one subprocess, a document job, Flower, Ctrl-C.

Each test runs `cortex up` in its own process group against a private Redis (a harness
`RedisServer` of its own, so no session worker of another test consumes its queues), on free
ports, with Flower behind basic auth. It submits a small document of echo actions, waits for
the job to complete, checks Flower (401 without credentials, 200 with; `/api/tasks` lists
the job's tasks with readable ids), then sends SIGINT and checks that every process the stack
started is gone. The second test does the same with RabbitMQ as the Celery broker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import harness

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
FLOWER_AUTH = ("ops", "s3cret-for-tests")
PROC = Path("/proc")


@pytest.fixture
def up_redis(tmp_path: Path) -> Iterator[harness.RedisServer]:
    server = harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


def _document() -> str:
    def action(ident: str, message: Any) -> str:
        body = json.dumps({"name": "echo", "parameters": {"message": message}})
        return f'<action type="tool" mode="async" id="{ident}">{body}</action>\n'

    return action("first", "hello") + action("second", "$first")


def _descendants(root: int) -> dict[int, str]:
    """pid -> kernel start time of every process below `root` (any session or group)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X"):
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        starts[pid] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = starts[pid]
        todo.extend(children.get(pid, []))
    return found


def _still_running(procs: dict[int, str]) -> list[int]:
    alive = []
    for pid, start in procs.items():
        try:
            stat = (PROC / str(pid) / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X") and fields[19] == start:
            alive.append(pid)
    return alive


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _run_up(env: dict[str, str], tmp_path: Path, *extra: str) -> None:
    """Start `cortex up`, run a job, check Flower, stop with SIGINT, check nothing is left."""
    api_port, flower_port = harness.free_port(), harness.free_port()
    env = {**env, "CORTEX_FLOWER_PORT": str(flower_port),
           "CORTEX_FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH)}
    started = time.monotonic()
    up = harness.Process([*harness.cortex_command(), "up", "--port", str(api_port),
                          "--pools", "agent,tool", "--log-dir", str(tmp_path / "logs"), *extra],
                         name="cortex-up", env=env, cwd=tmp_path, log_dir=tmp_path)
    api = f"http://127.0.0.1:{api_port}"
    flower = f"http://127.0.0.1:{flower_port}"
    try:
        harness.wait_until(lambda: "Cortex is up" in up.log_text() or not up.alive, timeout=60,
                           interval=0.2, message=lambda: up.describe(60))
        assert up.alive, up.describe(60)
        ready_s = time.monotonic() - started
        log = up.log_text()
        assert f"Flower {flower} (basic auth)" in log, up.describe(60)
        assert FLOWER_AUTH[1] not in log  # the password is never printed
        if "--broker" in extra:
            assert "broker: amqp://guest:***@127.0.0.1:5672//" in log, up.describe(60)
        assert httpx.get(f"{api}/readyz", timeout=5).status_code == 200

        response = httpx.post(f"{api}/v1/jobs", json={"protocol": _document()}, timeout=30)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]

        def finished() -> dict[str, Any] | None:
            job = httpx.get(f"{api}/v1/jobs/{job_id}", timeout=5).json()
            return job if job["status"] not in ("queued", "running") else None

        job = harness.wait_until(finished, timeout=20, interval=0.1,
                                 message=lambda: up.describe(80))
        assert job["status"] == "completed", job
        assert {a["id"]: a["status"] for a in job["actions"]} == {"first": "ok", "second": "ok"}

        assert httpx.get(f"{flower}/healthcheck", timeout=5).status_code == 200
        assert httpx.get(f"{flower}/api/tasks", timeout=5).status_code == 401
        assert httpx.get(f"{flower}/api/tasks", auth=("ops", "wrong"), timeout=5).status_code == 401

        def job_tasks() -> list[dict[str, Any]]:
            response = httpx.get(f"{flower}/api/tasks", auth=FLOWER_AUTH, timeout=5)
            assert response.status_code == 200, response.text
            return [t for t in response.json().values() if job_id in (t.get("args") or "")
                    and t.get("state") == "SUCCESS"]

        # Flower learns of tasks from worker events: give it a moment after the job ends.
        tasks = harness.wait_until(lambda: len(job_tasks()) >= 3 and job_tasks(), timeout=10,
                                   interval=0.2)
        actions = {t["name"]: t for t in tasks if "'first'" in t["args"]}
        assert actions, tasks
        task = next(iter(actions.values()))
        # readiness tasks carry an argsrepr naming the tool; canvas steps show their args
        assert task["args"] in (f"('{job_id}', 'first', 'echo')", f"('{job_id}', 'first')"), task
        assert task["routing_key"] == "tool"

        stack = _descendants(up.pid)
        assert len(stack) >= 4, stack  # two workers, the API, Flower (and their children)
        stop_started = time.monotonic()
        up.kill(signal.SIGINT)  # Ctrl-C: the stack's processes are in their own sessions
        assert up.wait_stopped(30), up.describe(40)
        stop_s = time.monotonic() - stop_started
        assert up.returncode == 0, up.describe(40)
        assert _still_running(stack) == [], up.describe(40)
        assert not _listening(api_port) and not _listening(flower_port)
        print(f"cortex up ({'amqp' if extra else 'redis'} broker): ready in {ready_s:.1f} s, "
              f"stopped in {stop_s:.1f} s, {len(stack)} processes")
    finally:
        if up.alive:
            leftovers = _descendants(up.pid)
            up.kill(signal.SIGINT)
            up.wait_stopped(30)
            for pid in _still_running(leftovers):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        up.stop()


def test_up_with_redis_broker(cortex_env: dict[str, str], up_redis: harness.RedisServer,
                              tmp_path: Path) -> None:
    _run_up({**cortex_env, "CORTEX_REDIS_URL": up_redis.url}, tmp_path)


def _prepare_rabbitmq() -> str | None:
    """Purge the pool queues on the local RabbitMQ; the reason to skip, or None."""
    from kombu import Connection, Exchange, Queue

    from cortex_worker.app import POOLS

    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            pass
    except OSError as exc:
        return f"no RabbitMQ answers at 127.0.0.1:5672 ({exc})"
    with Connection(AMQP_URL, connect_timeout=5) as conn:
        channel = conn.channel()
        for name in POOLS:
            Queue(name, Exchange(name, type="direct"), routing_key=name)(channel).declare()
            _, _, consumers = channel.queue_declare(queue=name, passive=True)
            if consumers:
                return (f"another Cortex worker consumes queue {name!r} on the local RabbitMQ; "
                        "it would take this test's tasks")
            channel.queue_purge(name)  # leftovers of earlier runs
    return None


def test_up_with_rabbitmq_broker(cortex_env: dict[str, str], up_redis: harness.RedisServer,
                                 tmp_path: Path) -> None:
    reason = _prepare_rabbitmq()
    if reason:
        pytest.skip(reason)
    _run_up({**cortex_env, "CORTEX_REDIS_URL": up_redis.url}, tmp_path, "--broker", AMQP_URL)
