"""Context feeds and internal actions, in agent jobs and documents (protocol.md §6)."""

from __future__ import annotations

from typing import Any

from tests.fake_llm import FakeLLM
from tests.integration.test_agents import (
    act,
    api,  # noqa: F401  (fixture)
    final,
    llm,  # noqa: F401  (fixture)
    messages,
    run_agent,
    turn,
    unique,
)
from tests.integration.test_documents import of, one, run


def user_text(server: FakeLLM, model: str, index: int) -> str:
    return messages(server, model, index)[-1]["content"]


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
