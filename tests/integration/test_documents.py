"""Protocol documents over the wire: API → Redis → Celery pools → event log → SSE.

What a document job does (results, events, statuses) is tested in-process, in
tests/engine/test_documents.py; here are what needs real workers (a revoke of a running
action), what waits on a timer (a timeout) and the API's own answers (SSE resumption, 422,
413, 404). The helpers `submit`, `follow`, `run`, `of`, `one` and `action` are shared by
other integration tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cortex_api.client import Client, Conflict
from cortex_api.models import JobOptions
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.limits import HOLD_S
from cortex_worker.store.state import Store
from tests import harness
from tests.fake_llm import FakeLLM, Turn


def submit(api: Any, protocol: str, **options: Any) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={"protocol": protocol, "options": options},
                      timeout=30)


def follow(api: Any, job_id: str, after: int | None = None, limit: int | None = None,
           timeout: float = 60) -> list[dict[str, Any]]:
    """Read the job's SSE stream until it closes (or `limit` events); return the events."""
    headers = {"Last-Event-ID": str(after)} if after is not None else {}
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events", headers=headers,
                      timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        data: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                events.append(json.loads("\n".join(data)))
                data = []
                if limit is not None and len(events) >= limit:
                    break
    return events


def run(api: Any, protocol: str, **options: Any) -> tuple[str, list[dict[str, Any]]]:
    response = submit(api, protocol, **options)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    return job_id, follow(api, job_id)


def of(events: list[dict[str, Any]], kind: str, action: str | None = None) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind
            and (action is None or e["data"].get("action_id") == action)]


def one(events: list[dict[str, Any]], kind: str, action: str | None = None) -> dict[str, Any]:
    found = of(events, kind, action)
    assert len(found) == 1, (kind, action, [e["type"] for e in events])
    return found[0]


def action(ident: str, name: str, params: dict[str, Any], mode: str = "async", **extra: Any) -> str:
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="tool" mode="{mode}" id="{ident}">{json.dumps(body)}</action>\n'


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


@pytest.fixture
def client(api: Any) -> Iterator[Client]:
    with Client(api.url) as cortex:
        yield cortex


def test_timeout_kills_the_action(client: Client) -> None:
    """The action's sandbox process is killed at its timeout (a lane that may wait on it)."""
    doc = action("slow", "python", {"code": "import time\ntime.sleep(120)"}, timeout=1)
    job_id = client.submit_document(doc).id
    events = list(client.events(job_id, timeout=60))
    (failed,) = [e for e in events
                 if e.type == "action_failed" and e.data["action_id"] == "slow"]
    # the 1 s timeout ended it, not the two minutes' sleep: the error names it
    assert failed.data["status"] == "timeout"
    assert failed.data["error"].startswith("timed out after 1s"), failed.data
    assert events[-1].type == "job_failed"


def test_an_llm_step_waits_in_its_queue_while_its_endpoint_is_paused(
        client: Client, cortex_env: dict[str, str], redis_server: harness.RedisServer,
        fake_llm: FakeLLM) -> None:
    """The documents' model endpoint is paused (a provider's 429 with a reset 15 s away, as
    every worker reads it from Redis). The chain's llm step is not claimed meanwhile: the job
    hears why (`model_waiting` naming the step), the step's task comes back for the pause's end
    (a Celery retry: the chain keeps its place), then runs once, as its first attempt, and the
    chain goes on. (15 s: the step must start within 10 s of the submission, to find the
    pause longer than `limits.HOLD_S`; it takes well under one.)"""
    endpoint = ModelConfig.model_validate(json.loads(cortex_env["CORTEX_DOCUMENT_MODEL"])).endpoint()
    fake_llm.script("documents", [Turn(text="the answer")])
    asked = len(fake_llm.requests("documents"))
    store = Store.from_url(redis_server.url)
    assert store.model_answer(endpoint, refused=True, reset_s=15.0, remaining=None) > HOLD_S
    doc = (action("a", "summarise", {"text": "x"}).replace('type="tool"', 'type="llm"')
           + action("b", "echo", {"message": "$a"}, depends_on=["a"]))
    job_id = client.submit_document(doc).id
    events = list(client.events(job_id, timeout=90))
    assert events[-1].type == "job_completed", "\n".join(f"{e.type} {e.data}" for e in events)
    kinds = [(e.type, e.data.get("action_id")) for e in events]
    waited = kinds.index(("model_waiting", "a"))
    started = [i for i, kind in enumerate(kinds) if kind == ("action_started", "a")]
    assert len(started) == 1 and waited < started[0], kinds
    assert events[started[0]].data["attempt"] == 1
    assert events[waited].data["reason"] == "paused" and events[waited].data["wait_s"] > HOLD_S
    (b,) = [e for e in events if e.type == "action_completed" and e.data["action_id"] == "b"]
    assert b.data["result"] == "the answer"
    assert len(fake_llm.requests("documents")) == asked + 1


def test_cancel_revokes_running_and_queued(client: Client) -> None:
    doc = (action("long", "sleep", {"seconds": 30})
           + action("next", "echo", {"message": "$long"}))
    job_id = client.submit_document(doc).id
    harness.wait_until(lambda: any(a.status == "running"
                                   for a in client.get_job(job_id).actions), timeout=20)
    client.cancel(job_id)
    job = client.wait(job_id, timeout=60)
    assert [e.type for e in client.events(job_id)][-1] == "job_cancelled"
    assert job.status == "cancelled"
    assert {a.status for a in job.actions} == {"cancelled"}
    with pytest.raises(Conflict):  # 409: it has ended
        client.cancel(job_id)


def test_fail_fast_ends_the_job_at_the_first_failure(client: Client) -> None:
    """`long` runs in a worker when `bad` fails: the job ends without waiting for it."""
    doc = action("bad", "fail", {"message": "nope"}) + action("long", "sleep", {"seconds": 120})
    job_id = client.submit_document(doc, options=JobOptions(fail_fast=True)).id
    events = list(client.events(job_id, timeout=60))
    last = events[-1]
    assert last.type == "job_failed"
    assert "fail_fast" in last.data["reason"]
    # it ended at the failure, not after the sleep: `bad` failed, then the job, and `long`
    # never finished before it
    ends = [(e.type, e.data.get("action_id")) for e in events
            if e.type in ("action_completed", "action_failed", "job_failed")]
    assert ends == [("action_failed", "bad"), ("job_failed", None)], ends


def test_sse_resume_delivers_every_event_once(api: Any) -> None:
    doc = "".join(action(f"e{i}", "echo", {"message": i}) for i in range(20))
    job_id, events = run(api, doc)
    cut = len(events) // 3
    resumed = follow(api, job_id, after=events[cut - 1]["seq"])
    assert [e["seq"] for e in events[:cut] + resumed] == [e["seq"] for e in events]
    again = httpx.get(f"{api.url}/v1/jobs/{job_id}/events?after={events[-3]['seq']}", timeout=30)
    assert again.text.count("\nevent: ") + again.text.startswith("event: ") >= 1


@pytest.mark.parametrize(("body", "kind"), [
    ('<action id="x">{"name": "echo", "parameters": {</action>', "invalid_json"),
    ('<action id="x">{"name": "no_such_tool"}</action>', "unknown_tool"),
    ('<action id="x">{"name": "calculator", "parameters": {"expression": 5}}</action>',
     "invalid_parameters"),
    ('<action id="a" depends_on="b">{"name":"echo"}</action>'
     '<action id="b" depends_on="a">{"name":"echo"}</action>', "cycle"),
])
def test_bad_documents_get_422_and_nothing_runs(api: Any, body: str, kind: str) -> None:
    before = httpx.get(f"{api.url}/v1/jobs?limit=5").json()["items"]
    response = submit(api, body)
    assert response.status_code == 422
    errors = response.json()["detail"]["errors"]
    assert kind in {e["kind"] for e in errors}
    assert all({"kind", "message", "line", "column"} <= set(e) for e in errors)
    after = httpx.get(f"{api.url}/v1/jobs?limit=5").json()["items"]
    assert [j["id"] for j in after] == [j["id"] for j in before]


def test_oversize_body_gets_413(api: Any) -> None:
    response = submit(api, "x" * (3 * 1024 * 1024))
    assert response.status_code == 413
    assert "limit" in response.text.lower()


def test_unknown_job_is_404(api: Any) -> None:
    assert httpx.get(f"{api.url}/v1/jobs/nope").status_code == 404
    assert httpx.get(f"{api.url}/v1/jobs/nope/events").status_code == 404
