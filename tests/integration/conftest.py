"""Fixtures for integration tests: a private Redis, Cortex workers and the API, per session.

Every test in this directory is marked `integration` automatically. Processes are started only
when a test asks for them, shared by the whole session, and always stopped at its end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import redis

from tests import harness
from tests.fake_anthropic import FakeAnthropic
from tests.fake_llm import FakeLLM

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
MANIFESTS_DIR = REPO_ROOT / "tests" / "manifests"

#: One worker per pool is started by the `workers` fixture.
WORKER_POOLS = ["agent", "tool", "llm", "relic"]
#: Concurrency per pool; pools not listed get `harness.DEFAULT_CONCURRENCY` (2).
WORKER_CONCURRENCY = {"tool": 4}
#: Log lines of each harness process shown when an integration test fails.
FAILURE_LOG_LINES = 40


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_integration(item):
            item.add_marker(pytest.mark.integration)


def _is_integration(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(HERE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failing integration test, attach the tail of every live harness process's log."""
    report = yield
    if report.failed and _is_integration(item):
        procs = harness.live_processes()
        if procs:
            text = "\n".join(p.describe(FAILURE_LOG_LINES) for p in procs)
            report.sections.append(("harness process logs", text))
    return report


@pytest.fixture(scope="session", autouse=True)
def _harness_session() -> Iterator[None]:
    """Kill leftovers of dead earlier runs; on SIGTERM run teardown; stop everything at the end."""
    harness.reap_orphans()
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:

        def on_sigterm(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")  # pytest runs the teardowns

        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
        harness.stop_all()


@pytest.fixture(scope="session")
def harness_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where process logs go (kept by pytest's basetemp for the last few runs) and processes run."""
    return tmp_path_factory.mktemp("harness")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A private redis-server of its own for one test (one it may stop, pause or flush)."""
    server = harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server(harness_dir: Path) -> Iterator[harness.RedisServer]:
    """A fresh private redis-server (memory only) for the whole session."""
    server = harness.RedisServer(log_dir=harness_dir, data_dir=harness_dir / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def fake_llm() -> Iterator[FakeLLM]:
    """The session's fake OpenAI-compatible model server (tests/fake_llm.py), started before
    any Cortex process: the test agents' `base_url` is `${CORTEX_TEST_LLM_URL}`, its `url`.
    It picks scripts by model name; give each test its own name (job option `model`)."""
    with FakeLLM() as server:
        yield server


@pytest.fixture(scope="session")
def fake_anthropic() -> Iterator[FakeAnthropic]:
    """The session's fake Anthropic Messages API server (tests/fake_anthropic.py), started
    before any Cortex process: the `claude_tester` agent's `base_url` is
    `${CORTEX_TEST_ANTHROPIC_URL}`, its `url`. It picks scripts by model name, like `fake_llm`."""
    with FakeAnthropic() as server:
        yield server


@pytest.fixture(scope="session")
def cortex_env(redis_server: harness.RedisServer, fake_llm: FakeLLM,
               fake_anthropic: FakeAnthropic,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for Cortex processes: this environment without any inherited `CORTEX_*`,
    `CELERY_*` or `REDIS_URL`, plus the test Redis, the test manifests, a temp workspace root
    and the fake model servers (`CORTEX_TEST_LLM_URL`, `CORTEX_TEST_ANTHROPIC_URL`). Copy it
    before changing it."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("CORTEX_", "CELERY_")) and key != "REDIS_URL"
    }
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    env["_TYPER_STANDARD_TRACEBACK"] = "1"  # plain tracebacks in the logs, not rich boxes
    env["CORTEX_REDIS_URL"] = redis_server.url
    env["CORTEX_MANIFESTS"] = str(MANIFESTS_DIR)
    env["CORTEX_WORKSPACE_ROOT"] = str(tmp_path_factory.mktemp("workspaces"))
    env["CORTEX_TEST_LLM_URL"] = fake_llm.url
    env["CORTEX_TEST_ANTHROPIC_URL"] = fake_anthropic.url
    # llm actions in documents answer from the fake model server under the name "documents"
    env["CORTEX_DOCUMENT_MODEL"] = json.dumps(
        {"base_url": "${CORTEX_TEST_LLM_URL}", "model": "documents", "api_key_env": None})
    return env


@pytest.fixture(scope="session")
def workers(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[dict[str, harness.Process]]:
    """One `cortex worker` per pool in `WORKER_POOLS`, all answering ping: pool -> Process."""
    pools = {pool: WORKER_CONCURRENCY.get(pool, harness.DEFAULT_CONCURRENCY)
             for pool in WORKER_POOLS}
    procs = harness.start_workers(pools, cortex_env, log_dir=harness_dir, cwd=harness_dir)
    try:
        yield procs
    finally:
        harness.stop_all(processes=list(procs.values()))


@pytest.fixture(scope="session")
def api(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    """A running `cortex api` (uvicorn) whose `GET /healthz` answered 200; see `.url`."""
    with harness.api_running(cortex_env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


@pytest.fixture
def redis_client(redis_server: harness.RedisServer) -> Iterator[redis.Redis]:
    """A client (str responses) of the session's Redis. Not flushed: see `clean_redis`."""
    client = redis_server.client(decode_responses=True)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def clean_redis(redis_client: redis.Redis) -> redis.Redis:
    """`redis_client` after FLUSHDB. Only for tests that own all state: it wipes what other
    session fixtures (workers' in-flight state) keep in Redis."""
    redis_client.flushdb()
    return redis_client
