"""Context feeds whose source is a workflow, and the API's answer to an unknown internal
action (protocol.md §6).

The rest of the feeds and internal actions is tested in-process, in
tests/engine/test_feeds_internal.py. A workflow source waits in place for the child job it
starts, which real workers run meanwhile: the stub broker runs one message at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cortex_api.client import Client
from cortex_api.models import JobOptions
from cortex_worker.protocol.events import Event
from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import (
    act,
    api,  # noqa: F401  (fixture)
    final,
    llm,  # noqa: F401  (fixture)
    messages,
    turn,
    unique,
)


@pytest.fixture
def client(api: Any) -> Iterator[Client]:  # noqa: F811
    with Client(api.url) as cortex:
        yield cortex


def user_text(server: FakeLLM, model: str, index: int) -> str:
    return messages(server, model, index)[-1]["content"]


def feed_value(text: str, feed_id: str) -> Any:
    """The value of the `<context_feed id="feed_id">` block in a prompt (JSON if it parses)."""
    found = re.search(rf'<context_feed id="{re.escape(feed_id)}">(.*?)</context_feed>', text,
                      re.DOTALL)
    assert found, f"no context feed {feed_id!r} in the prompt:\n{text}"
    try:
        return json.loads(found.group(1))
    except ValueError:
        return found.group(1)


def one(events: list[Event], kind: str, action_id: str | None = None) -> dict[str, Any]:
    """The data of the one event of that type (and action)."""
    found = [e for e in events if e.type == kind
             and (action_id is None or e.data.get("action_id") == action_id)]
    assert len(found) == 1, (kind, action_id, [e.type for e in events])
    return found[0].data


def test_an_unknown_internal_action_is_rejected(api: Any) -> None:  # noqa: F811
    doc = act("x", "reboot_universe", {}, kind="internal")
    response = httpx.post(f"{api.url}/v1/jobs", json={"protocol": doc})
    assert response.status_code == 422
    assert {e["kind"] for e in response.json()["detail"]["errors"]} == {"unknown_internal_action"}


# ------------------------------------------------------------------ workflow sources


def test_a_workflow_feed_shows_the_workflows_output_or_its_failure(
        client: Client, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("wffeed")
    board = {"id": "board", "source": {"type": "workflow", "name": "diamond",
                                       "params": {"x": 5, "label": "five"}}}
    broken = {"id": "broken_flow", "source": {"type": "workflow", "name": "failing",
                                              "params": {"reason": "no data today"}}}
    llm.script(model, [
        turn(act("add", "add_context_feed", board, mode="async", kind="internal")
             + act("add2", "add_context_feed", broken, mode="async", kind="internal")),
        turn(final("total=$board.total copy=$board.copy")),
    ])
    job_id = client.submit_agent("feed_lab", "go", options=JobOptions(model=model)).id
    events = list(client.events(job_id, timeout=60))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "job_completed", events[-1]
    # diamond(5): double 10, plus one 11, copied 10; its output is the feed's value
    expected = {"label": "five", "total": 11, "copy": 10, "text": "x=5"}
    assert one(events, "action_completed", "add")["result"]["value"] == expected
    assert feed_value(user_text(llm, model, 1), "board") == expected
    assert one(events, "response_end")["text"] == "total=11 copy=10"
    # a workflow that fails gives an error value naming it and its failed step; the job goes on
    value = one(events, "action_completed", "add2")["result"]["value"]
    assert set(value) == {"error"}
    assert value["error"].startswith("context feed 'broken_flow' failed: workflow 'failing' failed")
    assert "step 'bad' (tool fail) failed" in value["error"] and "no data today" in value["error"]
    assert feed_value(user_text(llm, model, 1), "broken_flow") == value
    warnings = [e.data for e in events if e.type == "warning"
                and e.data.get("kind") == "feed_failed"]
    assert {w["feed_id"] for w in warnings} == {"broken_flow"}  # computed twice: add, turn 2
    assert len(warnings) == 2


def test_a_workflow_feed_is_cancelled_with_the_job_that_waits_for_it(
        client: Client, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("wfcancel")
    feed = {"id": "slow", "source": {"type": "workflow", "name": "sleepy",
                                     "params": {"seconds": 30}}}
    llm.script(model, [turn(act("add", "add_context_feed", feed, kind="internal")),
                       turn(final("never"))])
    job_id = client.submit_agent("feed_lab", "go", options=JobOptions(model=model)).id

    def the_workflow() -> str | None:
        for item in client.list_jobs(status="running", limit=20).items:
            job = client.get_job(item.id)
            if job.kind == "workflow" and any(a.id == "nap" for a in job.actions):
                return item.id
        return None

    child = harness.wait_until(the_workflow, timeout=15)
    client.cancel(job_id)
    # the feed's wait notices within its poll and cancels the workflow it started
    harness.wait_until(lambda: client.get_job(child).status == "cancelled", timeout=10)
