"""`GET /v1/models`: the named model endpoints and the inline ones with limits, with their
live use read from the real Redis (`Store.model_use`), through the app and the Python client."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cortex_api.app import create_app
from cortex_api.client import Client
from cortex_api.deps import get_store
from cortex_api.routes.registry import registry_dep
from cortex_worker.handles import get_registry
from cortex_worker.manifests.loader import Registry, load_registry
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store.state import Store
from tests.manifest_helpers import write

MANIFESTS = """\
kind: Model
name: fast-gpt
description: The team's account.
base_url: ${LLM_URL}
model: gpt-4o-mini
api_key_env: null
limits: {requests_per_minute: 600, max_concurrent: 8}
---
kind: Model
name: spare
provider: anthropic
---
agents:
  - name: writer
    model: fast-gpt
  - name: local
    model: {base_url: "http://127.0.0.1:9/v1", model: qwen, api_key_env: null,
            limits: {max_concurrent: 2}}
  - name: local_too
    model: {base_url: "http://127.0.0.1:9/v1", model: qwen, api_key_env: null}
  - name: elsewhere
    model: {base_url: "http://127.0.0.1:9/v1", model: other, api_key_env: null}
workflows:
  - name: digest
    model: fast-gpt
    steps: [{id: s, type: llm, name: summarize, parameters: {prompt: hi}}]
"""


def _client(store: Store, registry: Registry, settings: Settings | None = None) -> TestClient:
    """The real app without its lifespan: its store is the test's, on the private Redis."""
    app = create_app(settings or get_settings())
    app.dependency_overrides[registry_dep] = lambda: registry
    app.dependency_overrides[get_store] = lambda: store
    return TestClient(app)


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    write(tmp_path, "m/all.yaml", MANIFESTS)
    return load_registry(tmp_path / "m")


def _take(store: Store, endpoint: str, holder: str) -> bool:
    taken, *_ = store.take_model_slot(endpoint, holder, "acme", lease_s=60,
                                      limits=(None, None, 8), tokens=10, stale_s=10)
    return taken


def test_models_lists_named_and_limited_inline_endpoints_with_their_use(
        store: Store, registry: Registry) -> None:
    assert _take(store, "fast-gpt", "j1:a") and _take(store, "fast-gpt", "j2:b")
    store.model_answer("fast-gpt", refused=True, reset_s=30, remaining=None)
    store.give_model_slot("fast-gpt", "j1:a", taken=10, used=12, tokens_per_minute=None)
    assert not _take(store, "fast-gpt", "j3:c")  # paused by the 429: it waits in line
    store.count_model_wait("fast-gpt")

    response = _client(store, registry).get("/v1/models")
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    inline = registry.agent("local").model.endpoint()
    assert [item["name"] for item in items] == ["fast-gpt", "spare", inline]

    fast = items[0]
    assert fast["declared"] == "Model" and fast["description"] == "The team's account."
    assert fast["base_url"] == "${LLM_URL}" and fast["model"] == "gpt-4o-mini"
    assert fast["limits"] == {"requests_per_minute": 600, "tokens_per_minute": None,
                              "max_concurrent": 8}
    assert fast["agents"] == ["writer"] and fast["workflows"] == ["digest"]
    assert fast["documents"] is False
    use = fast["use"]
    assert 29 < use.pop("paused_for_s") <= 30
    assert use == {"in_flight": 1, "waiting": 1, "adaptive_max_concurrent": 1,
                   "requests": 2, "rate_limited": 1, "waits": 1}

    spare = items[1]  # declared, used by nothing, never called
    assert spare["provider"] == "anthropic" and spare["base_url"] == "https://api.anthropic.com/v1"
    assert spare["limits"] is None and spare["agents"] == [] and spare["workflows"] == []
    assert spare["use"] == {"in_flight": 0, "waiting": 0, "paused_for_s": 0.0,
                            "adaptive_max_concurrent": None, "requests": 0,
                            "rate_limited": 0, "waits": 0}

    local = items[2]  # the same inline block: one endpoint, the agent without limits too
    assert local["declared"] == "inline" and local["model"] == "qwen"
    assert local["limits"]["max_concurrent"] == 2
    assert local["agents"] == ["local", "local_too"]
    assert "api_key" not in response.text


def test_agents_show_the_model_they_name(store: Store, registry: Registry) -> None:
    agents = {a["name"]: a for a in _client(store, registry).get("/v1/agents").json()["items"]}
    assert agents["writer"]["model"]["name"] == "fast-gpt"
    assert agents["writer"]["model"]["limits"]["max_concurrent"] == 8
    assert agents["elsewhere"]["model"]["name"] is None
    assert agents["elsewhere"]["model"]["limits"] is None


def test_the_test_manifests_model_and_a_named_document_model(store: Store) -> None:
    settings = get_settings().model_copy(update={"document_model": "limited"})
    items = _client(store, get_registry(), settings).get("/v1/models").json()["items"]
    assert [item["name"] for item in items] == ["limited"]
    assert items[0]["documents"] is True and items[0]["agents"] == []


def test_models_needs_a_key_when_the_api_has_keys(store: Store, registry: Registry) -> None:
    key = secrets.token_urlsafe(24)
    client = _client(store, registry, Settings(api_keys=f"acme:{key}"))
    assert client.get("/v1/models").status_code == 401
    response = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200


def test_the_python_client_lists_models(store: Store, registry: Registry) -> None:
    with Client("http://testserver") as cortex:
        cortex._http = _client(store, registry)  # the app in-process, through httpx
        models = cortex.list_models()
    assert [m.name for m in models][:2] == ["fast-gpt", "spare"]
    assert models[0].limits is not None and models[0].limits.requests_per_minute == 600
    assert models[0].use.requests == 0
