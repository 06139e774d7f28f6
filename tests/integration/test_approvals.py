"""Human approval against the real stack: API, workers, Redis, and the Python client.

`deploy` (tests/manifests/tools.yaml) has `require_approval: true`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex_api.client import Client, Conflict, Event, NotFound
from tests import harness

DOCUMENT = (
    '<action type="tool" mode="async" id="a">{"name": "echo", "parameters": {"message": "web-1"}}'
    "</action>\n"
    '<action type="tool" mode="async" id="d">{"name": "deploy", "parameters": {"target": "$a"}}'
    "</action>\n"
    "<response>deployed: $d</response>"
)
ALPHA, BETA = secrets.token_urlsafe(16), secrets.token_urlsafe(16)


@pytest.fixture
def client(workers: Any, api: harness.Process) -> Iterator[Client]:
    with Client(api.url) as cortex:
        yield cortex


def until_requested(client: Client, job_id: str) -> Event:
    """The job's `approval_requested` event (it is read live, as a dashboard would)."""
    for event in client.events(job_id, timeout=30):
        if event.type == "approval_requested":
            return event
    raise AssertionError(f"job {job_id} ended without asking for approval")


def test_an_approved_action_runs_and_the_job_completes(client: Client) -> None:
    job_id = client.submit_document(DOCUMENT).id
    request = until_requested(client, job_id)
    assert request.data["parameters"] == {"target": "web-1"}
    view = client.get_job(job_id)
    assert view.status == "running"
    assert {a.id: a.status for a in view.actions} == {"a": "ok", "d": "awaiting_approval"}

    decision = client.approve(job_id, "d")
    assert (decision.job_id, decision.action_id, decision.decision) == (job_id, "d", "approved")
    done = client.wait(job_id, timeout=30)
    assert done.status == "completed"
    assert done.result == 'deployed: {"deployed": "web-1"}'
    with pytest.raises(Conflict, match=r"the job has ended \(completed\)"):
        client.approve(job_id, "d")


def test_a_rejection_fails_the_action_with_its_reason(client: Client) -> None:
    job_id = client.submit_document(DOCUMENT).id
    until_requested(client, job_id)
    assert client.reject(job_id, "d", reason="change freeze").decision == "rejected"
    done = client.wait(job_id, timeout=30)
    assert done.status == "failed"
    action = {a.id: a for a in done.actions}["d"]
    assert action.status == "error" and action.error == "rejected by api: change freeze"
    kinds = [e.type for e in client.events(job_id)]
    assert kinds.index("approval_requested") < kinds.index("action_rejected") \
        < kinds.index("action_failed")
    with pytest.raises(NotFound, match="has no action 'nope'"):
        client.approve(job_id, "nope")
    with pytest.raises(Conflict, match="the job has ended"):
        client.reject(job_id, "d")


@pytest.fixture(scope="module")
def tenants_api(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    """An API of its own with two tenants' keys (the session's `api` has none)."""
    env = {**cortex_env, "CORTEX_API_KEYS": f"alpha:{ALPHA},beta:{BETA}"}
    with harness.api_running(env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


def test_only_the_jobs_tenant_may_answer(workers: Any, tenants_api: harness.Process) -> None:
    with Client(tenants_api.url, api_key=ALPHA) as alpha, \
            Client(tenants_api.url, api_key=BETA) as beta:
        job_id = alpha.submit_document(DOCUMENT).id
        until_requested(alpha, job_id)
        with pytest.raises(NotFound):
            beta.approve(job_id, "d")
        with pytest.raises(NotFound):
            beta.reject(job_id, "d", reason="not mine")
        alpha.approve(job_id, "d")
        assert alpha.wait(job_id, timeout=30).status == "completed"
        approved = [e for e in alpha.events(job_id) if e.type == "action_approved"]
        assert json.dumps(approved[0].data) == json.dumps(
            {"action_id": "d", "by": "tenant alpha", "reason": None})


def test_the_cli_approves_and_rejects(client: Client, api: harness.Process,
                                      cortex_env: dict[str, str]) -> None:
    env = {**cortex_env, "CORTEX_API_URL": api.url}
    first, second = (client.submit_document(DOCUMENT).id for _ in range(2))
    until_requested(client, first)
    until_requested(client, second)
    approved = harness.run_cortex(env, "approve", first, "d")
    assert approved.returncode == 0 and f"action d of job {first}: approved" in approved.stdout
    rejected = harness.run_cortex(env, "reject", second, "d", "--reason", "not today")
    assert rejected.returncode == 0, rejected.stdout + rejected.stderr
    assert client.wait(first, timeout=30).status == "completed"
    failed = client.wait(second, timeout=30)
    assert {a.id: a.error for a in failed.actions}["d"] == "rejected by api: not today"
    again = harness.run_cortex(env, "approve", first, "d")
    assert again.returncode == 1 and "does not await approval" in again.stdout
