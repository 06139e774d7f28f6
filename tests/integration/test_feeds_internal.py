"""Context feeds and internal actions, in agent jobs and documents (protocol.md §6)."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import (
    act,
    api,  # noqa: F401  (fixture)
    final,
    llm,  # noqa: F401  (fixture)
    messages,
    run_agent,
    start,
    turn,
    unique,
)
from tests.integration.test_documents import of, one, run


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


def test_manifest_feeds_reach_the_prompt_and_a_failing_source_is_reported(
        api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("feeds")
    llm.script(model, [turn(act("s", "sleep", {"seconds": 1.0}, mode="async")
                            + '<response final="false">waiting</response>'),
                       turn(final("$greeting / $clock"))])
    _, events = run_agent(api, "feeder", "go", model=model)
    assert events[-1]["type"] == "job_completed", events[-1]
    first = user_text(llm, model, 0)
    assert '<context_feed id="clock">' in first
    assert '<context_feed id="greeting">hello from a feed</context_feed>' in first
    assert "the feed source broke" in first  # the error is shown, the job goes on
    # a relic source runs on the relic pool; max_tokens (5, about 20 characters) cuts it
    assert '<context_feed id="remembered">{"key":"feed-test-ne…[truncated to 5 tokens]' in first
    warning = [e for e in of(events, "warning") if e["data"].get("kind") == "feed_failed"]
    assert warning and warning[0]["data"]["feed_id"] == "broken"
    # the periodic feed was refreshed while the sleep ran, and is in the next prompt
    updates = [e for e in of(events, "feed_updated") if e["data"]["feed_id"] == "stats"]
    assert len(updates) >= 2
    assert '<context_feed id="stats">' in user_text(llm, model, 1)
    end = of(events, "response_end")[-1]["data"]["text"]
    assert end.startswith("hello from a feed / 20")  # $greeting and the ISO clock


def test_set_variable_is_an_implicit_dependency(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("setvar")
    llm.script(model, [turn(
        act("sv", "set_variable", {"name": "colour", "value": {"name": "teal"}}, mode="async",
            kind="internal")
        + act("e", "echo", {"message": "$colour.name"}, mode="async")
        + final("done"))])
    _, events = run_agent(api, "feeder", "go", model=model)
    assert events[-1]["type"] == "job_completed"
    assert one(events, "action_completed", "e")["data"]["result"] == "teal"
    started = {e["data"]["action_id"]: e["seq"] for e in of(events, "action_started")}
    assert started["sv"] < started["e"]


def test_feeds_added_and_removed_at_run_time(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("addfeed")
    feed = {"id": "motto", "source": {"type": "tool", "name": "echo",
                                      "params": {"message": "ship it"}}}
    llm.script(model, [
        turn(act("add", "add_context_feed", feed, kind="internal")),
        turn(act("use", "echo", {"message": "$motto"}, mode="async")
             + act("ls", "list_context_feeds", {}, mode="async", kind="internal")
             + act("rm", "remove_context_feed", {"id": "motto"}, kind="internal")),
        turn(final("ok")),
    ])
    _, events = run_agent(api, "feeder", "go", model=model)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_completed", "add")["data"]["result"]["value"] == "ship it"
    assert one(events, "action_completed", "use")["data"]["result"] == "ship it"
    listed = {f["id"] for f in one(events, "action_completed", "ls")["data"]["result"]}
    assert listed == {"clock", "stats", "greeting", "broken", "remembered", "motto"}
    assert '<context_feed id="motto">ship it</context_feed>' in user_text(llm, model, 1)
    assert '<context_feed id="motto">' not in user_text(llm, model, 2)


def test_a_blocked_internal_action_is_refused_and_fed_back(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("blocked")
    llm.script(model, [turn(act("wipe", "clear_context", {}, kind="internal")),
                       turn(final("understood"))])
    _, events = run_agent(api, "blocked", "go", model=model)
    assert events[-1]["type"] == "job_completed"
    failed = one(events, "action_failed", "wipe")["data"]
    assert "not allowed" in failed["error"] and "clear_context" in failed["error"]
    assert '<result id="wipe" status="error">' in user_text(llm, model, 1)


def test_clear_context_forgets_the_conversation(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("clear")
    llm.script(model, [turn(act("e", "echo", {"message": 1})),
                       turn(act("wipe", "clear_context", {}, kind="internal")),
                       turn(final("fresh start"))])
    _, events = run_agent(api, "feeder", "go", model=model)
    assert events[-1]["type"] == "job_completed"
    # It ran while turn 2 was generated: turn 1's two messages are forgotten; turn 2 (which
    # holds the call) and the result of the wipe are what the model sees next.
    assert one(events, "action_completed", "wipe")["data"]["result"] == {"cleared_messages": 2}
    third = messages(llm, model, 2)
    assert [m["role"] for m in third] == ["user", "assistant", "user"]
    assert '<result id="e" status="ok">' in third[0]["content"]
    assert '<result id="wipe" status="ok">' in third[2]["content"]


def test_internal_actions_in_a_document(workers: Any, api: Any) -> None:  # noqa: F811
    doc = (act("sv", "set_variable", {"name": "n", "value": 21}, mode="async", kind="internal")
           + act("calc", "calculator", {"expression": "$n * 2"}, mode="async")
           + '<action type="internal" id="gone">{"name": "delete_variable", '
             '"parameters": {"name": "n"}, "depends_on": ["calc"]}</action>'
           + "<response>$calc</response>")
    _, events = run(api, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_completed", "calc")["data"]["result"] == 42
    assert one(events, "action_completed", "gone")["data"]["result"] == {"name": "n", "deleted": True}
    assert one(events, "response_end")["data"]["text"] == "42"


def test_an_unknown_internal_action_is_rejected(workers: Any, api: Any) -> None:  # noqa: F811
    import httpx

    doc = act("x", "reboot_universe", {}, kind="internal")
    response = httpx.post(f"{api.url}/v1/jobs", json={"protocol": doc})
    assert response.status_code == 422
    assert {e["kind"] for e in response.json()["detail"]["errors"]} == {"unknown_internal_action"}


# ------------------------------------------------------------------ llm, workflow and cache


def test_an_llm_feed_is_answered_by_the_jobs_model_before_the_turn(
        api: Any, llm: FakeLLM) -> None:  # noqa: F811
    # llm_feeder's `forecast` feed (an llm source, declared in its manifest) asks the job's
    # model, as its llm actions do: here the option `model` names it. The feed is computed
    # while the prompt is built: its request comes first.
    model = unique("llmfeed")
    llm.script(model, [turn('{"city": "Oslo", "sky": "snow"}'),
                       turn(final("$forecast.sky in $forecast.city"))])
    _, events = run_agent(api, "llm_feeder", "what will the weather be?", model=model)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert llm.remaining(model) == 0
    feed_request, turn_request = llm.requests(model)
    # a one-task completion: the source's name in the system message, its prompt as the user's
    assert [m["role"] for m in feed_request["messages"]] == ["system", "user"]
    assert "You perform one task: weather_forecast." in feed_request["messages"][0]["content"]
    assert feed_request["messages"][1]["content"] == "Tomorrow's weather in Oslo, as JSON"
    # the answer parsed as JSON: in the prompt, and as the variable $forecast
    prompt = turn_request["messages"][-1]["content"]
    assert "what will the weather be?" in prompt
    assert feed_value(prompt, "forecast") == {"city": "Oslo", "sky": "snow"}
    assert one(events, "response_end")["data"]["text"] == "snow in Oslo"
    assert not [e for e in of(events, "warning") if e["data"].get("kind") == "feed_failed"]


def test_a_workflow_feed_shows_the_workflows_output_or_its_failure(
        api: Any, llm: FakeLLM) -> None:  # noqa: F811
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
    _, events = run_agent(api, "feed_lab", "go", model=model)
    assert events[-1]["type"] == "job_completed", events[-1]
    # diamond(5): double 10, plus one 11, copied 10; its output is the feed's value
    expected = {"label": "five", "total": 11, "copy": 10, "text": "x=5"}
    assert one(events, "action_completed", "add")["data"]["result"]["value"] == expected
    assert feed_value(user_text(llm, model, 1), "board") == expected
    assert one(events, "response_end")["data"]["text"] == "total=11 copy=10"
    # a workflow that fails gives an error value naming it and its failed step; the job goes on
    value = one(events, "action_completed", "add2")["data"]["result"]["value"]
    assert set(value) == {"error"}
    assert value["error"].startswith("context feed 'broken_flow' failed: workflow 'failing' failed")
    assert "step 'bad' (tool fail) failed" in value["error"] and "no data today" in value["error"]
    assert feed_value(user_text(llm, model, 1), "broken_flow") == value
    warnings = [e["data"] for e in of(events, "warning") if e["data"].get("kind") == "feed_failed"]
    assert {w["feed_id"] for w in warnings} == {"broken_flow"}  # computed twice: add, turn 2
    assert len(warnings) == 2


def test_a_cached_feed_is_shared_by_the_jobs_of_an_agent_until_its_ttl_runs_out(
        api: Any, llm: FakeLLM, cortex_env: dict[str, str]) -> None:  # noqa: F811
    # The source, count_calls, counts its runs in the workspace of the job that runs it, and
    # names that job in its value. The feed id is new to this run: nothing is cached under it
    # yet (the cache is per tenant, agent, feed id and source, and outlives the jobs).
    ttl = 6.0  # room for a slow machine: job 2 must build its prompt within it
    feed_id = f"tally_{uuid.uuid4().hex[:8]}"
    feed = {"id": feed_id, "cache_ttl": ttl,
            "source": {"type": "tool", "name": "count_calls", "params": {"key": "tally"}}}
    first, second = unique("cache1"), unique("cache2")
    llm.script(first, [turn(act("add", "add_context_feed", feed, kind="internal")),
                       turn(final("one"))])
    llm.script(second, [turn(act("add", "add_context_feed", feed, kind="internal")),
                        turn(act("nap", "sleep", {"seconds": ttl + 0.3})),
                        turn(final("two"))])

    def calls_in(job_id: str) -> int:
        counter = Path(cortex_env["CORTEX_WORKSPACE_ROOT"]) / job_id / ".count_calls/tally.count"
        return int(counter.read_text()) if counter.exists() else 0

    started = time.monotonic()
    job1, events = run_agent(api, "feed_lab", "go", model=first)
    assert events[-1]["type"] == "job_completed", events[-1]
    made = {"key": "tally", "calls": 1, "job": job1}
    assert one(events, "action_completed", "add")["data"]["result"]["value"] == made
    assert feed_value(user_text(llm, first, 1), feed_id) == made
    assert calls_in(job1) == 1  # its second prompt took the cached value

    job2, events = run_agent(api, "feed_lab", "go", model=second)
    assert events[-1]["type"] == "job_completed", events[-1]
    # (the value was made after `started`, and job 2's second prompt before its request came)
    built = llm.requests(second)[1]["received_at"]
    assert built - started < ttl, f"too slow to test the cache: {built - started:.2f} s"
    # another job of the agent gets the value job 1 made, and the source does not run for it
    assert one(events, "action_completed", "add")["data"]["result"]["value"] == made
    assert feed_value(user_text(llm, second, 1), feed_id) == made
    # after the sleep the TTL has run out: its next prompt computes the feed again
    assert feed_value(user_text(llm, second, 2), feed_id) == {"key": "tally", "calls": 1,
                                                               "job": job2}
    assert (calls_in(job1), calls_in(job2)) == (1, 1)


def test_a_run_time_feed_obeys_the_agents_lists(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    """A model cannot reach through a feed what its manifest does not let it call."""
    model = unique("sneaky")
    code = {"id": "sneaky", "source": {"type": "tool", "name": "python",
                                       "params": {"code": "print(6 * 7 * 1000003)"}}}
    flow = {"id": "flow", "source": {"type": "workflow", "name": "diamond", "params": {"x": 1}}}
    llm.script(model, [turn(act("a", "add_context_feed", code, mode="async", kind="internal")
                            + act("b", "add_context_feed", flow, mode="async", kind="internal")),
                       turn(final("done"))])
    _, events = run_agent(api, "feeder", "go", model=model)  # tools: echo, sleep, fail
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_failed", "a")["data"]["error"].startswith(
        "context feed 'sneaky': tool 'python' is not available to agent 'feeder'")
    assert one(events, "action_failed", "b")["data"]["error"] == (
        "context feed 'flow': workflow 'diamond' is not available to agent 'feeder'")
    prompt = user_text(llm, model, 1)  # the refusals are fed back; no feed was added
    assert '<context_feed id="sneaky">' not in prompt and '<context_feed id="flow">' not in prompt
    assert str(6 * 7 * 1000003) not in json.dumps(events)  # the code never ran


def test_feeds_share_a_cache_only_with_the_same_source(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    feed_id = f"motto_{uuid.uuid4().hex[:8]}"

    def motto(message: str, ttl: float) -> dict[str, Any]:
        return {"id": feed_id, "cache_ttl": ttl,
                "source": {"type": "tool", "name": "echo", "params": {"message": message}}}

    values = []
    for message, ttl in (("ship it", 60), ("hold it", 60), ("tiny ttl", 0.0001)):
        model = unique("motto")
        llm.script(model, [turn(act("add", "add_context_feed", motto(message, ttl),
                                    kind="internal")),
                           turn(final("ok"))])
        _, events = run_agent(api, "feed_lab", "go", model=model)
        assert events[-1]["type"] == "job_completed", events[-1]
        values.append(one(events, "action_completed", "add")["data"]["result"]["value"])
    assert values == ["ship it", "hold it", "tiny ttl"]


def test_an_llm_feed_in_a_document_asks_the_document_model(
        workers: Any, api: Any, llm: FakeLLM) -> None:  # noqa: F811
    llm.script("documents", [turn("a summary")])
    feed = {"id": "summary", "source": {"type": "llm", "name": "summarize",
                                        "params": {"prompt": "the logs"}}}
    doc = act("add", "add_context_feed", feed, kind="internal") + "<response>$summary</response>"
    _, events = run(api, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "response_end")["data"]["text"] == "a summary"


def test_a_workflow_feed_is_cancelled_with_the_job_that_waits_for_it(
        api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("wfcancel")
    feed = {"id": "slow", "source": {"type": "workflow", "name": "sleepy",
                                     "params": {"seconds": 30}}}
    llm.script(model, [turn(act("add", "add_context_feed", feed, kind="internal")),
                       turn(final("never"))])
    job_id = start(api, "feed_lab", "go", model=model)

    def the_workflow() -> str | None:
        running = httpx.get(f"{api.url}/v1/jobs?status=running&limit=20", timeout=10).json()
        for item in running["items"]:
            job = httpx.get(f"{api.url}/v1/jobs/{item['id']}", timeout=10).json()
            if job["kind"] == "workflow" and any(a["id"] == "nap" for a in job["actions"]):
                return str(item["id"])
        return None

    child = harness.wait_until(the_workflow, timeout=15)
    assert httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", timeout=10).status_code == 200
    # the feed's wait notices within its poll and cancels the workflow it started
    harness.wait_until(lambda: httpx.get(f"{api.url}/v1/jobs/{child}", timeout=10).json()[
        "status"] == "cancelled", timeout=10)
