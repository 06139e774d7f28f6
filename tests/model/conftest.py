"""Fixtures of the real-model tests: SmolLM2-135M-Instruct on llama.cpp's server, and the engine
in-process (as tests/engine) with agents that talk to it.

Every test here is marked `model` and is never skipped: when the runtime cannot be built or
the server does not start, the tests fail with the reason. The first run on a machine builds
llama-cpp-python from source (minutes); later runs take it from the cache outside the clone
(`${CORTEX_CACHE_DIR:-~/.cache/cortex}`, scripts/model_runtime.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex_worker import handles as runtime
from cortex_worker.actions import dispatch
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.harness import RedisServer
from tests.model import agents
from tests.model.runtime import LlamaServer, ModelRuntime, RuntimeSetupError, engine, prepare

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def model_runtime() -> ModelRuntime:
    try:
        return prepare()
    except RuntimeSetupError as exc:
        pytest.fail(f"the model runtime could not be prepared: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def llama_server(model_runtime: ModelRuntime,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    try:
        server = LlamaServer(model_runtime, log_dir=tmp_path_factory.mktemp("llama-server"))
    except RuntimeSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


@pytest.fixture(scope="package")
def model_engine(llama_server: LlamaServer,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The engine of this process on a private Redis, with tests/model/agents.py's agents."""
    manifests = agents.write_manifests(tmp_path_factory.mktemp("model-manifests"))
    with engine(manifests, {"CORTEX_SMOLLM_URL": llama_server.url}) as redis_server:
        yield redis_server


@pytest.fixture
def store(model_engine: RedisServer) -> Store:
    store = runtime.get_store()
    store.redis.flushdb()
    return store


@pytest.fixture
def broker(store: Store) -> Iterator[StubBroker]:
    stub = StubBroker()
    with dispatch.use_broker(stub):
        yield stub
