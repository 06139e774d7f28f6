"""Protocol documents run end to end: API → Redis → Celery pools → event log → SSE."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.manifest_helpers import CORPUS

TERMINAL = {"job_completed", "job_failed", "job_cancelled"}


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


FAILS_AS_A_DOCUMENT = {
    # written for an agent whose manifest declares the feed `system_metrics`: submitted as a
    # document it has no such feed, and updating it fails with a precise error
    "mk1_05_internal_actions": (
        "update_metrics_feed", "no context feed 'system_metrics'; add it with add_context_feed"),
}


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.xml")), ids=lambda p: p.stem)
def test_corpus_documents_run(api: Any, path: Path, fake_llm: Any) -> None:
    from cortex_worker.protocol.document import load_document
    from tests.fake_llm import Turn

    text = path.read_text()
    for spec in load_document(text).actions:  # the agents it calls answer from the fake model
        if spec.type.value == "agent":
            fake_llm.script(spec.name, [Turn(
                text=f'<response final="true">{spec.name} looked at it</response>',
                tokens_per_second=2000)])
        if spec.type.value == "llm":  # CORTEX_DOCUMENT_MODEL: model "documents"
            fake_llm.script("documents", [Turn(text="the model's answer",
                                               tokens_per_second=2000)])
    response = submit(api, text)
    assert response.status_code == 202, response.text
    events = follow(api, response.json()["id"])
    failed_feeds = [w["data"] for w in of(events, "warning") if w["data"]["kind"] == "feed_failed"]
    assert failed_feeds == []
    if path.stem in FAILS_AS_A_DOCUMENT:
        action_id, error = FAILS_AS_A_DOCUMENT[path.stem]
        assert events[-1]["type"] == "job_failed", events[-1]
        assert one(events, "action_failed", action_id)["data"]["error"] == error
        return
    assert events[-1]["type"] == "job_completed", (
        events[-1], [e["data"] for e in events if e["type"] in ("action_failed", "warning")])
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    for spec in load_document(text).actions:
        if spec.type.value == "agent":  # the child's final response is the action's value
            done = one(events, "action_completed", spec.id)["data"]["result"]
            assert done == f"{spec.name} looked at it"
        if spec.type.value == "llm":
            done = one(events, "action_completed", spec.id)["data"]["result"]
            assert done == "the model's answer"
    assert fake_llm.remaining("documents") == 0


def test_tools_document_renders_its_response(api: Any) -> None:
    doc = (action("search", "web_scraper", {"url": "https://example.com"})
           + action("calc", "calculator", {"expression": "42 + 8"}, mode="sync",
                    depends_on=["search"], output_key="total")
           + "<response>The total is $total; the page was ${search.url}.</response>")
    job_id, events = run(api, doc)
    assert one(events, "action_completed", "calc")["data"]["result"] == 50
    end = one(events, "response_end")["data"]
    assert end["text"] == "The total is 50; the page was https://example.com."
    assert events[-1]["type"] == "job_completed"
    job = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "completed"


def test_n_shape_starts_c_before_b_completes(api: Any) -> None:
    # A=0.05 s, B=0.3 s, C=0.3 s after A, D=0.05 s after A and B. Waves would hold C for B.
    doc = (action("A", "sleep", {"seconds": 0.05}) + action("B", "sleep", {"seconds": 0.3})
           + action("C", "sleep", {"seconds": 0.3}, depends_on=["A"])
           + action("D", "sleep", {"seconds": 0.05}, depends_on=["A", "B"]))
    _, events = run(api, doc)
    assert events[-1]["type"] == "job_completed"
    seq = {(e["type"], e["data"].get("action_id")): e["seq"] for e in events}
    assert seq[("action_started", "C")] < seq[("action_completed", "B")]
    assert seq[("action_started", "D")] > seq[("action_completed", "B")]
    assert seq[("action_started", "D")] > seq[("action_completed", "A")]


def test_failure_skips_dependents_unless_continue(api: Any) -> None:
    doc = (action("bad", "fail", {"message": "boom"})
           + action("after", "echo", {"message": "$bad"}, depends_on=["bad"])
           + action("chained", "echo", {"message": "$after"})
           + action("rescue", "echo", {"message": "$bad"}, on_error="continue"))
    _job_id, events = run(api, doc)
    assert "boom" in one(events, "action_failed", "bad")["data"]["error"]
    assert one(events, "action_skipped", "after")["data"]["reason"] == "dependency bad did not succeed"
    assert one(events, "action_skipped", "chained")
    rescued = one(events, "action_completed", "rescue")["data"]["result"]
    assert rescued["status"] == "error" and "boom" in rescued["error"]
    assert events[-1]["type"] == "job_failed"


def test_retry_until_success(api: Any) -> None:
    doc = action("f", "flaky", {"key": "k1", "failures": 2}, retry=2)
    _, events = run(api, doc)
    assert len(of(events, "action_retrying", "f")) == 2
    assert [e["data"]["attempt"] for e in of(events, "action_started", "f")] == [1, 2, 3]
    assert one(events, "action_completed", "f")
    assert events[-1]["type"] == "job_completed"


def test_timeout_kills_the_action(api: Any) -> None:
    doc = action("slow", "python", {"code": "import time\ntime.sleep(120)"}, timeout=1)
    started = time.monotonic()
    _, events = run(api, doc)
    failed = one(events, "action_failed", "slow")["data"]
    assert failed["status"] == "timeout"
    assert time.monotonic() - started < 60  # the timeout ended it, not the two minutes' sleep
    assert events[-1]["type"] == "job_failed"


def test_cancel_revokes_running_and_queued(api: Any) -> None:
    doc = (action("long", "sleep", {"seconds": 30})
           + action("next", "echo", {"message": "$long"}))
    response = submit(api, doc)
    job_id = response.json()["id"]
    follow(api, job_id, limit=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        actions = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()["actions"]
        if any(a["status"] == "running" for a in actions):
            break
        time.sleep(0.05)
    cancel = httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel")
    assert cancel.status_code in (200, 202), cancel.text
    events = follow(api, job_id)
    assert events[-1]["type"] == "job_cancelled"
    job = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "cancelled"
    assert {a["status"] for a in job["actions"]} == {"cancelled"}
    assert httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel").status_code == 409


def test_fail_fast_ends_the_job_at_the_first_failure(api: Any) -> None:
    doc = action("bad", "fail", {"message": "nope"}) + action("long", "sleep", {"seconds": 120})
    started = time.monotonic()
    _, events = run(api, doc, fail_fast=True)
    assert events[-1]["type"] == "job_failed"
    assert "fail_fast" in events[-1]["data"]["reason"]
    assert time.monotonic() - started < 60  # it ended at the failure, not after the sleep


def test_sse_resume_delivers_every_event_once(api: Any) -> None:
    doc = "".join(action(f"e{i}", "echo", {"message": i}) for i in range(20))
    job_id, events = run(api, doc)
    cut = len(events) // 3
    resumed = follow(api, job_id, after=events[cut - 1]["seq"])
    assert [e["seq"] for e in events[:cut] + resumed] == [e["seq"] for e in events]
    again = httpx.get(f"{api.url}/v1/jobs/{job_id}/events?after={events[-3]['seq']}", timeout=30)
    assert again.text.count("\nevent: ") + again.text.startswith("event: ") >= 1


def test_canvas_and_readiness_give_the_same_results(api: Any) -> None:
    doc = (action("a", "echo", {"message": 1}) + action("b", "calculator", {"expression": "2*3"},
                                                         depends_on=["a"])
           + action("c", "echo", {"message": "$a"}) + action("d", "echo", {"message": ["$b", "$c"]}))
    results = {}
    for canvas in (True, False):
        job_id, events = run(api, doc, canvas=canvas)
        assert events[-1]["type"] == "job_completed"
        job = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()
        results[canvas] = (
            job.get("dispatch"),
            {e["data"]["action_id"]: e["data"]["result"] for e in of(events, "action_completed")},
            sorted(e["type"] for e in events),
        )
    assert results[True][1] == results[False][1] == {"a": 1, "b": 6, "c": 1, "d": [6, 1]}
    assert results[True][2] == results[False][2]


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
