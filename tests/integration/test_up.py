"""`cortex up` end to end: the whole stack as one subprocess, a document job, Flower, stopping.

Each test runs `cortex up` in its own process group on free ports, with Flower behind basic
auth. The first two use a private Redis (a harness `RedisServer` of their own, so no session
worker of another test consumes its queues), submit a small document of echo actions, wait
for the job to complete, check Flower (401 without credentials, 200 with; `/api/tasks` lists
the job's tasks with readable ids), then send SIGINT (Ctrl-C); the second uses RabbitMQ as
the Celery broker. The others let `cortex up` start its own Redis and stop it the ways a
service manager, `docker stop` or a closed terminal do: SIGTERM, and SIGHUP followed by a
second signal while it stops. Every time, every process the stack started (its process tree
and process groups, taken before the signal) must be gone, the ports closed, and the exit
code 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex_api.stack import GRACE_S, redis_binary
from cortex_worker.jobs.record import JOB_TERMINAL
from tests import harness

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
FLOWER_AUTH = ("ops", "s3cret-for-tests")
#: Two graces (the workers, API and Flower, then Redis) and reaping: the most a stop may take.
STOP_BOUND_S = 2 * GRACE_S + 5


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


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _start_up(env: dict[str, str], tmp_path: Path, *extra: str) -> tuple[harness.Process, str, str]:
    """`cortex up` with the agent and tool pools and Flower (basic auth), once it says it is up;
    with its API and Flower URLs."""
    api_port, flower_port = harness.free_port(), harness.free_port()
    env = {**env, "CORTEX_FLOWER_PORT": str(flower_port),
           "CORTEX_FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH)}
    up = harness.Process([*harness.cortex_command(), "up", "--port", str(api_port),
                          "--pools", "agent,tool", "--log-dir", str(tmp_path / "logs"), *extra],
                         name="cortex-up", env=env, cwd=tmp_path, log_dir=tmp_path)
    harness.wait_until(lambda: "Cortex is up" in up.log_text() or not up.alive, timeout=60,
                       interval=0.2, message=lambda: up.describe(60))
    assert up.alive, up.describe(60)
    return up, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{flower_port}"


def _stop_up(up: harness.Process, *signals: int, urls: tuple[str, ...]) -> float:
    """Send `signals` to `cortex up` (the later ones once its workers say they were told to
    stop, so that they arrive while it stops); check that it exits 0 having stopped every
    process it started (`STOP_BOUND_S` is the backstop), and that nothing answers at `urls`.
    Returns the seconds the stop took, to print."""
    stack = harness.process_tree(up.pid)
    assert len(stack) >= 4, stack  # two workers, the API, Flower (and their children)
    before = len(up.log_text())
    started = time.monotonic()
    try:
        for number, sig in enumerate(signals):
            if number:  # the stop has begun: the stack sent its workers SIGTERM
                harness.wait_until(lambda: "Warm shutdown" in up.log_text()[before:],
                                   timeout=STOP_BOUND_S, interval=0.02,
                                   message=lambda: up.describe(40))
            up.kill(sig)  # the stack's processes have their own sessions: only `cortex up` gets it
        assert up.wait_stopped(STOP_BOUND_S), up.describe(40)
        took = time.monotonic() - started
        assert up.returncode == 0, up.describe(40)
    finally:
        left = harness.left_behind(stack, timeout=5)
        for pid in left:  # orphans of a failed stop: not left to later tests
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert left == [], up.describe(40)
    for url in urls:
        assert not _listening(int(url.rsplit(":", 1)[1])), url
    return took


@contextlib.contextmanager
def _cleaned_up(up: harness.Process) -> Iterator[None]:
    """Whatever a failed test leaves of the stack is killed, not left to later tests."""
    try:
        yield
    finally:
        if up.alive:
            leftovers = harness.process_tree(up.pid)
            up.kill(signal.SIGINT)
            up.wait_stopped(STOP_BOUND_S)
            for pid in harness.left_behind(leftovers, timeout=5):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        up.stop()


def _second_up_refuses(env: dict[str, str], tmp_path: Path, api: str, flower: str) -> None:
    """A second `cortex up` on the same ports and log directory exits 1 saying why, before it
    starts anything: it never says it is up, and the first stack's logs keep what they had."""
    logs = tmp_path / "logs"
    before = {path.name: path.read_bytes() for path in logs.glob("*.log")}
    api_port, flower_port = api.rsplit(":", 1)[1], flower.rsplit(":", 1)[1]
    second = harness.Process([*harness.cortex_command(), "up", "--port", api_port,
                              "--pools", "agent,tool", "--log-dir", str(logs)],
                             name="cortex-up-again", env={**env, "CORTEX_FLOWER_PORT": flower_port},
                             cwd=tmp_path, log_dir=tmp_path)
    try:
        assert second.wait_stopped(60), second.describe(40)
    finally:
        second.stop()
    out = second.log_text()
    assert second.returncode == 1, out
    assert (f"port {api_port} (the API, --port) and {flower_port} (Flower, CORTEX_FLOWER_PORT)"
            in " ".join(out.split())), out
    assert "Cortex is up" not in out
    assert before and all((logs / name).read_bytes().startswith(content)
                          for name, content in before.items())


def _run_up(env: dict[str, str], tmp_path: Path, *extra: str) -> None:
    """Start `cortex up`, run a job, check Flower, see a second `cortex up` refused, stop with
    SIGINT, check nothing is left."""
    started = time.monotonic()
    up, api, flower = _start_up(env, tmp_path, *extra)
    with _cleaned_up(up):
        ready_s = time.monotonic() - started
        log = up.log_text()
        assert f"Flower {flower} (basic auth)" in log, up.describe(60)
        assert f"Redis {env['CORTEX_REDIS_URL']} (CORTEX_REDIS_URL)" in log, up.describe(60)
        assert FLOWER_AUTH[1] not in log  # the password is never printed
        if "--broker" in extra:
            assert "broker: amqp://guest:***@127.0.0.1:5672//" in log, up.describe(60)
        assert httpx.get(f"{api}/readyz", timeout=5).status_code == 200

        response = httpx.post(f"{api}/v1/jobs", json={"protocol": _document()}, timeout=30)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]

        def finished() -> dict[str, Any] | None:
            job = httpx.get(f"{api}/v1/jobs/{job_id}", timeout=5).json()
            return job if job["status"] in JOB_TERMINAL else None  # not `finishing` either

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

        _second_up_refuses(env, tmp_path, api, flower)
        stop_s = _stop_up(up, signal.SIGINT, urls=(api, flower))  # Ctrl-C
        print(f"cortex up ({'amqp' if extra else 'redis'} broker): ready in {ready_s:.1f} s, "
              f"stopped in {stop_s:.1f} s")


def test_up_with_redis_broker(cortex_env: dict[str, str], up_redis: harness.RedisServer,
                              tmp_path: Path) -> None:
    _run_up({**cortex_env, "CORTEX_REDIS_URL": up_redis.url}, tmp_path)


def _prepare_rabbitmq() -> str | None:
    """Purge the pool queues on the local RabbitMQ; the reason to skip, or None."""
    from kombu import Connection, Exchange, Queue

    from cortex_worker.pools import NAMES as POOLS

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


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGHUP, signal.SIGTERM)],
                         ids=["sigterm", "sighup-then-sigterm"])
def test_a_stop_signal_stops_everything_up_started(cortex_env: dict[str, str], tmp_path: Path,
                                                   signals: tuple[int, ...]) -> None:
    """systemd, `docker stop` and `timeout` send SIGTERM, a closed terminal SIGHUP; a second
    signal while the stack stops (an impatient supervisor) must not cut the stop short. No
    Redis is configured, so the stack runs (and must stop) its own."""
    if redis_binary() is None:
        pytest.skip("no redis-server for `cortex up` to start")
    env = {k: v for k, v in cortex_env.items() if k != "CORTEX_REDIS_URL"}
    up, api, flower = _start_up(env, tmp_path)
    with _cleaned_up(up):
        assert "redis | " in up.log_text(), up.describe(60)  # its own Redis is in the tree
        assert re.search(r"Redis (redis://127\.0\.0\.1:\d+/0) \(private: in memory, stopped "
                         r"with the stack\); .* export CORTEX_REDIS_URL=\1", up.log_text())
        assert httpx.get(f"{flower}/healthcheck", timeout=5).status_code == 200
        # a second signal, sent once the stop has begun, hurries it and does not cut it short:
        # it still ends with exit 0, every process gone and the ports closed (that a hurried
        # stop SIGKILLs what is left at once, not after its grace, is shown on the stop's own
        # clock in tests/unit/test_stack.py)
        took = _stop_up(up, *signals, urls=(api, flower))
        print(f"cortex up: {' then '.join(signal.Signals(s).name for s in signals)} "
              f"stopped it in {took:.1f} s")
