"""Usage and quotas (cortex_worker.jobs.usage), in-process on the real Redis: what each model
request spends is counted per job and per tenant and endpoint; the job's end event and view
show it; `GET /v1/usage` sums a tenant's days; a tenant over its budget cannot submit (429),
and a job that runs out mid-run ends `failed` with `quota_exceeded`."""

from __future__ import annotations

import json
import uuid

import pytest
from fastapi.testclient import TestClient

from cortex_api.app import create_app
from cortex_api.deps import get_store
from cortex_worker.errors import QuotaExceededError
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs import usage
from cortex_worker.jobs.options import JobOptions
from cortex_worker.settings import Settings, get_settings
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import events, of, status
from tests.fake_llm import FakeLLM, Turn

FAST = 5000.0


def act(ident: str) -> str:
    body = json.dumps({"name": "calculator", "parameters": {"expression": "1 + 1"}})
    return f'<action type="tool" mode="sync" id="{ident}">{body}</action>'


def final(text: str) -> str:
    return f'<response final="true">{text}</response>'


@pytest.fixture
def quotas(monkeypatch: pytest.MonkeyPatch) -> None:
    """acme may spend 10 tokens a day (a turn's prompt alone is more)."""
    monkeypatch.setenv("CORTEX_QUOTAS", json.dumps({"acme": {"tokens_per_day": 10}}))
    get_settings.cache_clear()
    yield
    monkeypatch.delenv("CORTEX_QUOTAS")
    get_settings.cache_clear()


def test_a_jobs_usage_is_in_its_end_event_its_view_and_its_tenants_day(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=act("a"), tokens_per_second=FAST),
                       Turn(text=final("2"), tokens_per_second=FAST)])
    job_id = jobs.submit_agent(store, "tester", "One plus one?", options=JobOptions(model=model),
                               tenant="globex")
    broker.join()
    assert status(store, job_id) == "completed"
    spent = usage.job_usage(store, job_id)
    assert len(spent) == 1
    (endpoint, counts), = spent.items()
    assert counts["requests"] == 2 and counts["prompt_tokens"] > 0
    assert counts["completion_tokens"] > 0
    # the fake server reports the usage it counted: the job's is the sum of its turns'
    reported = [e["data"] for e in of(events(store, job_id), "usage")]
    assert counts["prompt_tokens"] == sum(u["prompt_tokens"] for u in reported)
    assert events(store, job_id)[-1]["data"]["usage"] == spent

    app = create_app(get_settings())
    app.dependency_overrides[get_store] = lambda: store
    with TestClient(app) as client:
        assert client.get(f"/v1/jobs/{job_id}").json()["usage"] == spent
        day, _ = usage.periods()
        report = client.get("/v1/usage", params={"tenant": "globex", "from": day,
                                                 "to": day}).json()
        assert report["endpoints"] == {endpoint: counts}
        assert report["total"] == counts and report["from"] == report["to"] == day
        assert client.get("/v1/usage", params={"from": "yesterday"}).status_code == 422


def test_a_tenant_over_budget_cannot_submit(store: Store, broker: StubBroker, llm: FakeLLM,
                                            quotas: None) -> None:
    """acme's first job spends more than its 10 tokens: the next submit is refused, in the
    engine and over HTTP (429, naming the budget); another tenant is not."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=final("hi"), tokens_per_second=FAST)])
    first = jobs.submit_agent(store, "tester", "Hi.", options=JobOptions(model=model),
                              tenant="acme")
    broker.join()
    assert status(store, first) == "completed"
    with pytest.raises(QuotaExceededError, match="quota_exceeded: tenant 'acme' has used"):
        jobs.submit_agent(store, "tester", "Again.", tenant="acme")
    app = create_app(Settings(api_keys="acme:acme-key-0123456789,globex:globex-key-0123456789"))
    app.dependency_overrides[get_store] = lambda: store
    with TestClient(app) as client:
        job = {"agent": "tester", "input": "Again."}
        refused = client.post("/v1/jobs", json=job, headers={"X-API-Key": "acme-key-0123456789"})
        assert refused.status_code == 429
        assert refused.json()["detail"]["message"].startswith(
            "quota_exceeded: tenant 'acme' has used")
        assert client.post("/v1/jobs", json=job,
                           headers={"X-API-Key": "globex-key-0123456789"}).status_code == 202  # no budget


def test_a_job_that_runs_out_mid_run_fails_with_quota_exceeded(
        store: Store, broker: StubBroker, llm: FakeLLM, quotas: None) -> None:
    """Turn 1 spends the budget; before turn 2's request the job ends `failed` with
    quota_exceeded, and turn 2 never reaches the model."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(text=act("a"), tokens_per_second=FAST),
                       Turn(text=final("2"), tokens_per_second=FAST)])
    job_id = jobs.submit_agent(store, "tester", "One plus one?", options=JobOptions(model=model),
                               tenant="acme")
    broker.join()
    assert status(store, job_id) == "failed"
    end = events(store, job_id)[-1]
    assert end["type"] == "job_failed" and end["data"]["error"].startswith("quota_exceeded")
    assert len(llm.requests(model)) == 1
    assert llm.remaining(model) == 1
