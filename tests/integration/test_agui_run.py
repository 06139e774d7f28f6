"""`POST /v1/agents/{name}/ag-ui` driven by AG-UI's reference client (`@ag-ui/client`'s
`HttpAgent`, its own verification on; tests/agui_client.py) against the real API and workers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import harness
from tests.agui_checks import assert_well_formed, parse
from tests.agui_client import Step, run_client, user
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import act, final, turn, unique, view


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:
    return api


def endpoint(api: harness.Process, agent: str = "tester") -> str:
    return f"{api.url}/v1/agents/{agent}/ag-ui"


def props(model: str) -> dict[str, Any]:
    """forwardedProps choosing the fake model's script (the thread's job options)."""
    return {"cortex": {"options": {"model": model}}}


def thread() -> str:
    return f"thread-{uuid.uuid4().hex[:8]}"


def test_a_new_thread_streams_a_whole_run(api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("agui-run")
    fake_llm.script(model, [
        turn("<thought>Adding.</thought>\n" + act("sum", "calculator", {"expression": "19 + 23"})),
        turn(final("The sum is $sum.")),
    ])
    tid = thread()
    report = run_client(endpoint(api), thread_id=tid, steps=[
        Step("run-1", [user("Add 19 and 23.")], forwarded_props=props(model))])
    run = report.steps[0]
    assert run.error is None and report.warnings == []
    assert_well_formed(run.events)
    started, job = run.events[0], run.events[1]
    assert (started["type"], started["threadId"], started["runId"]) == ("RUN_STARTED", tid, "run-1")
    assert job["type"] == "CUSTOM" and job["name"] == "cortex.run"
    job_id = job["value"]["jobId"]
    finished = run.events[-1]
    assert finished["type"] == "RUN_FINISHED" and finished["runId"] == "run-1"
    assert finished["result"] == "The sum is 42." and finished["usage"][0]["totalTokens"] > 0
    assert view(api, job_id)["status"] == "completed"
    texts = [m["content"] for m in report.messages if m["role"] == "assistant" and m.get("content")]
    assert texts == ["The sum is 42."]
