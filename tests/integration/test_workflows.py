"""Workflows end to end: POST /v1/jobs {"workflow"} and `type="workflow"` actions in documents.

The workflows are in tests/manifests/workflows.yaml: `diamond` (calculator and echo steps on
`$inputs.x`), `failing` (a step that fails, one after it), `nested` (a workflow step) and
`sleepy` (a step that sleeps).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import pytest
import redis

from cortex_worker.store.keys import job_keys
from tests import harness
from tests.integration.test_documents import action, follow, of, one

DIAMOND_X3 = {"label": "sum", "total": 7, "copy": 6, "text": "x=3"}


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


def post(api: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json=body, timeout=30)


def run_workflow(api: Any, name: str, inputs: dict[str, Any],
                 **options: Any) -> tuple[str, list[dict[str, Any]]]:
    response = post(api, {"workflow": name, "inputs": inputs, "options": options})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert response.headers["Location"] == f"/v1/jobs/{job_id}"
    return job_id, follow(api, job_id)


def run_document(api: Any, text: str) -> tuple[str, list[dict[str, Any]]]:
    response = post(api, {"protocol": text})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    return job_id, follow(api, job_id)


def view(api: Any, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def workflow_action(ident: str, name: str, inputs: dict[str, Any], mode: str = "async") -> str:
    body = json.dumps({"name": name, "parameters": inputs})
    return f'<action type="workflow" mode="{mode}" id="{ident}">{body}</action>\n'


def child_of(events: list[dict[str, Any]], action_id: str) -> str:
    return one(events, "child_job", action_id)["data"]["job_id"]


def results(events: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["data"]["action_id"]: e["data"]["result"] for e in of(events, "action_completed")}


def seq(events: list[dict[str, Any]], kind: str, action_id: str) -> int:
    return one(events, kind, action_id)["seq"]


# ------------------------------------------------------------------------------ runs


@pytest.mark.parametrize("canvas", [True, False], ids=["canvas", "readiness"])
def test_diamond_runs_from_post(api: Any, redis_client: redis.Redis, canvas: bool) -> None:
    job_id, events = run_workflow(api, "diamond", {"x": 3}, canvas=canvas)
    assert events[0]["type"] == "job_queued"
    assert events[0]["data"]["workflow"] == "diamond" and events[0]["data"]["steps"] == 4
    assert [e["data"]["action"]["id"] for e in of(events, "action_parsed")] == [
        "double", "plus_one", "copy", "join"]
    assert results(events) == {"double": 6, "plus_one": 7, "copy": 6,
                               "join": {"plus_one": 7, "copy": 6}}
    # the DAG's order: the two middle steps after `double`, `join` after both
    for middle in ("plus_one", "copy"):
        assert seq(events, "action_started", middle) > seq(events, "action_completed", "double")
        assert seq(events, "action_started", "join") > seq(events, "action_completed", middle)
    end = events[-1]
    assert end["type"] == "job_completed" and end["data"]["result"] == DIAMOND_X3
    job = view(api, job_id)
    assert job["status"] == "completed" and job["kind"] == "workflow"
    assert json.loads(job["result"]) == DIAMOND_X3
    assert [a["id"] for a in job["actions"]] == ["double", "plus_one", "copy", "join"]
    dispatch = redis_client.hget(job_keys(job_id).job, "dispatch")
    assert dispatch == ("canvas" if canvas else "readiness")


def test_a_workflow_step_runs_a_child_workflow(api: Any) -> None:
    job_id, events = run_workflow(api, "nested", {"n": 2})
    assert events[-1]["type"] == "job_completed", events[-1]
    assert events[-1]["data"]["result"] == 50  # diamond(2): total 5; times ten
    child = view(api, child_of(events, "inner"))
    assert (child["parent_job"], child["parent_action"], child["status"]) == (
        job_id, "inner", "completed")
    assert results(events)["inner"]["total"] == 5


def test_workflow_action_in_a_document(api: Any) -> None:
    doc = (workflow_action("wf", "diamond", {"x": 5, "label": "five"})
           + action("use", "echo", {"message": "${wf.total}"})
           + action("free", "echo", {"message": "independent"})
           + "<response>Total: ${wf.total} ($wf.label)</response>")
    job_id, events = run_document(api, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    output = {"label": "five", "total": 11, "copy": 10, "text": "x=5"}
    assert results(events) == {"wf": output, "use": 11, "free": "independent"}
    assert seq(events, "action_started", "use") > seq(events, "action_completed", "wf")
    assert one(events, "response_end")["data"]["text"] == "Total: 11 (five)"
    child_id = child_of(events, "wf")
    assert child_id == uuid.uuid5(uuid.NAMESPACE_URL, f"cortex:{job_id}:wf").hex
    child = view(api, child_id)
    assert (child["kind"], child["parent_job"], child["parent_action"], child["status"]) == (
        "workflow", job_id, "wf", "completed")
    assert json.loads(child["result"]) == output
    child_events = follow(api, child_id)
    assert child_events[0]["data"]["parent_job"] == job_id
    assert child_events[-1]["data"]["result"] == output


# ------------------------------------------------------------------------------ rejections


def test_invalid_inputs_are_422(api: Any) -> None:
    response = post(api, {"workflow": "diamond", "inputs": {"x": "three"}})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail["message"] == ("the workflow was rejected: workflow 'diamond': inputs.x: "
                                 "'three' is not of type 'integer'")
    assert [(e["kind"], e["path"]) for e in detail["errors"]] == [("invalid_inputs", "inputs.x")]
    response = post(api, {"workflow": "diamond", "inputs": {}})
    assert response.status_code == 422
    assert response.json()["detail"]["errors"][0]["message"] == (
        "workflow 'diamond': inputs: 'x' is a required property")


def test_unknown_workflow_is_422(api: Any) -> None:
    response = post(api, {"workflow": "ghost", "inputs": {"x": 1}})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail["errors"][0]["kind"] == "unknown_workflow"
    assert detail["message"].startswith("the workflow was rejected: no workflow named 'ghost' "
                                        "(registered: diamond, ")
    doc = workflow_action("wf", "ghost", {})
    response = post(api, {"protocol": doc})
    assert response.status_code == 422
    assert [e["kind"] for e in response.json()["detail"]["errors"]] == ["unknown_workflow"]


def test_workflow_with_another_kind_is_422(api: Any) -> None:
    response = post(api, {"workflow": "diamond", "protocol": "<response>x</response>"})
    assert response.status_code == 422
    assert "give exactly one of" in response.json()["detail"]["message"]


# ------------------------------------------------------------------------------ failures


def test_a_failing_step_fails_the_run(api: Any) -> None:
    job_id, events = run_workflow(api, "failing", {"reason": "boom"})
    assert "boom" in one(events, "action_failed", "bad")["data"]["error"]
    assert one(events, "action_skipped", "after")["data"]["reason"] == \
        "dependency bad did not succeed"
    end = events[-1]
    assert end["type"] == "job_failed" and end["data"]["result"] is None
    error = end["data"]["error"]
    assert error.startswith("workflow 'failing': step 'bad' (tool fail) failed: ")
    assert "boom" in error and error.endswith("; not run: after")
    assert view(api, job_id)["error"] == error


def test_a_failing_child_fails_the_parent_action(api: Any) -> None:
    doc = (workflow_action("wf", "failing", {"reason": "kaput"})
           + action("use", "echo", {"message": "$wf"})
           + action("free", "echo", {"message": "still runs"}))
    _, events = run_document(api, doc)
    failed = one(events, "action_failed", "wf")["data"]
    assert "workflow 'failing': step 'bad' (tool fail) failed" in failed["error"]
    assert "kaput" in failed["error"]
    assert one(events, "action_skipped", "use")["data"]["reason"] == \
        "dependency wf did not succeed"
    assert results(events) == {"free": "still runs"}
    assert events[-1]["type"] == "job_failed"
    assert view(api, child_of(events, "wf"))["status"] == "failed"
    # the pools survive: the next run completes
    _, again = run_workflow(api, "diamond", {"x": 3})
    assert again[-1]["type"] == "job_completed" and again[-1]["data"]["result"] == DIAMOND_X3


def test_cancelling_a_child_fails_the_parent_action(api: Any) -> None:
    doc = workflow_action("wf", "sleepy", {"seconds": 120}) + action("use", "echo", {"message": "$wf"})
    response = post(api, {"protocol": doc})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    child_id = uuid.uuid5(uuid.NAMESPACE_URL, f"cortex:{job_id}:wf").hex

    def napping() -> bool:
        child = httpx.get(f"{api.url}/v1/jobs/{child_id}", timeout=30)
        return child.status_code == 200 and any(a["status"] == "running"
                                                for a in child.json()["actions"])

    harness.wait_until(napping, timeout=30, message=f"child {child_id} never started its step")
    started = time.monotonic()
    assert httpx.post(f"{api.url}/v1/jobs/{child_id}/cancel", timeout=30).status_code == 200
    events = follow(api, job_id)
    assert time.monotonic() - started < 60  # the cancel ended it, not the two minutes' sleep
    assert "cancelled" in one(events, "action_failed", "wf")["data"]["error"]
    assert one(events, "action_skipped", "use")
    assert events[-1]["type"] == "job_failed"
    assert view(api, child_id)["status"] == "cancelled"


def test_a_child_job_action_past_its_timeout_times_out_and_cancels_the_child(api: Any) -> None:
    from cortex_worker.jobs.lifecycle import child_job_id

    doc = ('<action type="workflow" mode="async" id="slow" timeout="1">'
           '{"name": "sleepy", "parameters": {"seconds": 120}}</action>'
           '<action type="tool" mode="async" id="after" depends_on="slow">'
           '{"name": "echo", "parameters": {"message": "never"}}</action>')
    started = time.monotonic()
    job_id, events = run_document(api, doc)
    assert time.monotonic() - started < 60  # the timeout ended it, not the two minutes' sleep
    failed = one(events, "action_failed", "slow")["data"]
    assert failed["status"] == "timeout" and "child job was cancelled" in failed["error"]
    assert one(events, "action_skipped", "after")
    child = httpx.get(f"{api.url}/v1/jobs/{child_job_id(job_id, 'slow')}").json()
    assert child["status"] == "cancelled"
