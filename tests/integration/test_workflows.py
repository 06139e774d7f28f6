"""Workflows over the wire: POST /v1/jobs {"workflow"}, its answer and its rejections.

What a workflow job does (steps, children, failures, cancels, timeouts) is tested in-process,
in tests/engine/test_workflows.py. The workflows are in tests/manifests/workflows.yaml.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from cortex_api.client import Client

DIAMOND_X3 = {"label": "sum", "total": 7, "copy": 6, "text": "x=3"}


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


def post(api: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json=body, timeout=30)


def workflow_action(ident: str, name: str, inputs: dict[str, Any], mode: str = "async") -> str:
    body = json.dumps({"name": name, "parameters": inputs})
    return f'<action type="workflow" mode="{mode}" id="{ident}">{body}</action>\n'


# ------------------------------------------------------------------------------ runs


def test_a_posted_workflow_is_accepted_and_viewed(api: Any) -> None:
    """The wire's part of a run: 202 with the job's `Location`, and the job's view (what
    the run does is tested in-process, tests/engine/test_workflows.py)."""
    response = post(api, {"workflow": "diamond", "inputs": {"x": 3}})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert response.headers["Location"] == f"/v1/jobs/{job_id}"
    with Client(api.url) as client:
        job = client.wait(job_id, timeout=60)
    assert job.status == "completed" and job.kind == "workflow"
    assert json.loads(job.result or "") == DIAMOND_X3
    assert [a.id for a in job.actions] == ["double", "plus_one", "copy", "join"]


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
