"""Fixtures for the in-process engine tests: a real Redis, `StubBroker` instead of Celery.

The engine (jobs, kinds, executor, coordinator, reconciler, the store's Lua scripts) runs in
this process: every message it sends goes to a `cortex_worker.testing.StubBroker`, whose
`join()` runs the tasks here, in order. No Celery worker, no broker connection; the state
lives in a private redis-server (one per session, flushed before each test), as in
production, so the Lua scripts are the real ones. Every test here is marked `engine`.

While this package runs, the process's settings read `CORTEX_REDIS_URL` (the private Redis),
`CORTEX_MANIFESTS` (tests/manifests), `CORTEX_WORKSPACE_ROOT` (a temp dir) and
`CORTEX_DOCUMENT_MODEL` (the fake model server's "documents", as in tests/integration), and no
other `CORTEX_*` variable; the cached settings, store and registry (`cortex_worker.handles`) are
dropped on the way in and out, so other test packages see their own again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex_worker import handles
from cortex_worker.actions import dispatch
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests import harness
from tests.fake_llm import FakeLLM

HERE = Path(__file__).resolve().parent
MANIFESTS_DIR = HERE.parent / "manifests"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def engine_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.RedisServer]:
    """A private redis-server (memory only) for the whole session."""
    where = tmp_path_factory.mktemp("engine-redis")
    with harness.RedisServer(log_dir=where, data_dir=where / "data") as server:
        yield server


@pytest.fixture(scope="package")
def engine_runtime(engine_redis: harness.RedisServer,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This process's settings, store and registry point at the private Redis and the test
    manifests while the package runs; the environment and caches are restored after."""
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if key.startswith("CORTEX_"):
                patch.delenv(key)
        patch.chdir(tmp_path_factory.mktemp("engine-cwd"))  # no `.env` file is read
        patch.setenv("CORTEX_REDIS_URL", engine_redis.url)
        patch.setenv("CORTEX_MANIFESTS", str(MANIFESTS_DIR))
        patch.setenv("CORTEX_WORKSPACE_ROOT", str(tmp_path_factory.mktemp("engine-workspaces")))
        # llm actions of documents answer from the fake model server under the name "documents"
        patch.setenv("CORTEX_DOCUMENT_MODEL", json.dumps(
            {"base_url": "${CORTEX_TEST_LLM_URL}", "model": "documents", "api_key_env": None}))
        handles.reset()
        try:
            yield
        finally:
            handles.reset()


@pytest.fixture
def store(engine_runtime: None, engine_redis: harness.RedisServer) -> Store:
    """The process's `Store` (`runtime.get_store()`, which the engine uses), on an empty Redis."""
    assert get_settings().redis_url == engine_redis.url  # never flush another Redis
    store = handles.get_store()
    store.redis.flushdb()
    return store


@pytest.fixture
def broker(store: Store) -> Iterator[StubBroker]:
    """A `StubBroker` installed as the process's broker for the test."""
    stub = StubBroker()
    with dispatch.use_broker(stub):
        yield stub


@pytest.fixture(scope="package")
def fake_llm() -> Iterator[FakeLLM]:
    """The tests' fake model server, on loopback, from a thread of this process."""
    with FakeLLM() as server:
        yield server


@pytest.fixture
def llm(fake_llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> FakeLLM:
    """The fake model server, named by `CORTEX_TEST_LLM_URL` as the test agents expect."""
    monkeypatch.setenv("CORTEX_TEST_LLM_URL", fake_llm.url)
    return fake_llm
