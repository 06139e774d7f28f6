"""Context feeds and internal actions, in agent jobs and documents (protocol.md §6), through
the engine in-process against the fake model server.

The agents are in tests/manifests/agents.yaml (`feeder`, `blocked`, `llm_feeder`,
`feed_lab`). Feeds whose source is a workflow wait in place for a child job, which the stub
cannot run meanwhile: they are tested in tests/integration/test_feeds_internal.py.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import events, of, one
from tests.fake_llm import FakeLLM, Turn

FAST = 5000.0  # tokens per second: a turn streams in a few milliseconds


def unique(tag: str) -> str:
    """A model name no other test uses: the fake server keeps one script queue per name."""
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def act(ident: str, name: str, params: dict[str, Any], mode: str = "sync",
        kind: str = "tool") -> str:
    body = json.dumps({"name": name, "parameters": params})
    return f'<action type="{kind}" mode="{mode}" id="{ident}">{body}</action>'


def final(text: str) -> str:
    return f'<response final="true">{text}</response>'


def turn(text: str) -> Turn:
    return Turn(text=text, tokens_per_second=FAST)


def run_agent(store: Store, broker: StubBroker, agent: str, text: str,
              model: str) -> tuple[str, list[dict[str, Any]]]:
    """Submit an agent job, run every message it sends, and return its id and event log."""
    job_id = jobs.submit_agent(store, agent, text, options=JobOptions(model=model))
    broker.join()
    return job_id, events(store, job_id)


def messages(llm: FakeLLM, model: str, index: int) -> list[dict[str, Any]]:
    """The chat messages of the model's `index`-th request, without the system prompt."""
    request = llm.requests(model)[index]
    assert request["messages"][0]["role"] == "system"
    return request["messages"][1:]


def user_text(llm: FakeLLM, model: str, index: int) -> str:
    return messages(llm, model, index)[-1]["content"]


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
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    model = unique("feeds")
    llm.script(model, [turn(act("s", "sleep", {"seconds": 0}, mode="async")
                            + '<response final="false">waiting</response>'),
                       turn(final("$greeting / $clock"))])
    job_id = jobs.submit_agent(store, "feeder", "go", options=JobOptions(model=model))
    while not broker.messages(dispatch.ACTION_TASK):  # the first turn sends the sleep
        assert broker.step() is not None, "the sleep was never sent"
    # the periodic feed is refreshed while the sleep runs: its refreshes fall due first
    for _ in range(2):
        (refresh,) = broker.messages(dispatch.FEED_TASK)
        broker.run(refresh)
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed", log[-1]
    first = user_text(llm, model, 0)
    assert '<context_feed id="clock">' in first
    assert '<context_feed id="greeting">hello from a feed</context_feed>' in first
    assert "the feed source broke" in first  # the error is shown, the job goes on
    # a relic source runs on the relic pool; max_tokens (5, about 20 characters) cuts it
    assert '<context_feed id="remembered">{"key":"feed-test-ne…[truncated to 5 tokens]' in first
    warning = [e for e in of(log, "warning") if e["data"].get("kind") == "feed_failed"]
    assert warning and warning[0]["data"]["feed_id"] == "broken"
    # the periodic feed was refreshed while the sleep ran, and is in the next prompt
    updates = [e for e in of(log, "feed_updated") if e["data"]["feed_id"] == "stats"]
    assert len(updates) >= 2
    assert '<context_feed id="stats">' in user_text(llm, model, 1)
    end = of(log, "response_end")[-1]["data"]["text"]
    assert end.startswith("hello from a feed / 20")  # $greeting and the ISO clock


def test_set_variable_is_an_implicit_dependency(store: Store, broker: StubBroker,
                                                llm: FakeLLM) -> None:
    model = unique("setvar")
    llm.script(model, [turn(
        act("sv", "set_variable", {"name": "colour", "value": {"name": "teal"}}, mode="async",
            kind="internal")
        + act("e", "echo", {"message": "$colour.name"}, mode="async")
        + final("done"))])
    _, log = run_agent(store, broker, "feeder", "go", model)
    assert log[-1]["type"] == "job_completed"
    assert one(log, "action_completed", "e")["result"] == "teal"
    started = {e["data"]["action_id"]: e["seq"] for e in of(log, "action_started")}
    assert started["sv"] < started["e"]


def test_feeds_added_and_removed_at_run_time(store: Store, broker: StubBroker,
                                             llm: FakeLLM) -> None:
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
    _, log = run_agent(store, broker, "feeder", "go", model)
    assert log[-1]["type"] == "job_completed", log[-1]
    assert one(log, "action_completed", "add")["result"]["value"] == "ship it"
    assert one(log, "action_completed", "use")["result"] == "ship it"
    listed = {f["id"] for f in one(log, "action_completed", "ls")["result"]}
    assert listed == {"clock", "stats", "greeting", "broken", "remembered", "motto"}
    assert '<context_feed id="motto">ship it</context_feed>' in user_text(llm, model, 1)
    assert '<context_feed id="motto">' not in user_text(llm, model, 2)


def test_a_blocked_internal_action_is_refused_and_fed_back(store: Store, broker: StubBroker,
                                                           llm: FakeLLM) -> None:
    model = unique("blocked")
    llm.script(model, [turn(act("wipe", "clear_context", {}, kind="internal")),
                       turn(final("understood"))])
    _, log = run_agent(store, broker, "blocked", "go", model)
    assert log[-1]["type"] == "job_completed"
    failed = one(log, "action_failed", "wipe")
    assert "not allowed" in failed["error"] and "clear_context" in failed["error"]
    assert '<result id="wipe" status="error">' in user_text(llm, model, 1)


def test_clear_context_forgets_the_conversation(store: Store, broker: StubBroker,
                                                llm: FakeLLM) -> None:
    model = unique("clear")
    llm.script(model, [turn(act("e", "echo", {"message": 1})),
                       turn(act("wipe", "clear_context", {}, kind="internal")),
                       turn(final("fresh start"))])
    _, log = run_agent(store, broker, "feeder", "go", model)
    assert log[-1]["type"] == "job_completed"
    # It ran while turn 2 was generated: turn 1's two messages are forgotten; turn 2 (which
    # holds the call) and the result of the wipe are what the model sees next.
    assert one(log, "action_completed", "wipe")["result"] == {"cleared_messages": 2}
    third = messages(llm, model, 2)
    assert [m["role"] for m in third] == ["user", "assistant", "user"]
    assert '<result id="e" status="ok">' in third[0]["content"]
    assert '<result id="wipe" status="ok">' in third[2]["content"]


def test_internal_actions_in_a_document(store: Store, broker: StubBroker) -> None:
    doc = (act("sv", "set_variable", {"name": "n", "value": 21}, mode="async", kind="internal")
           + act("calc", "calculator", {"expression": "$n * 2"}, mode="async")
           + '<action type="internal" id="gone">{"name": "delete_variable", '
             '"parameters": {"name": "n"}, "depends_on": ["calc"]}</action>'
           + "<response>$calc</response>")
    job_id = jobs.submit_document(store, doc)
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed", log[-1]
    assert one(log, "action_completed", "calc")["result"] == 42
    assert one(log, "action_completed", "gone")["result"] == {"name": "n", "deleted": True}
    assert one(log, "response_end")["text"] == "42"


# ------------------------------------------------------------------ llm sources and the cache


def test_an_llm_feed_is_answered_by_the_jobs_model_before_the_turn(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    # llm_feeder's `forecast` feed (an llm source, declared in its manifest) asks the job's
    # model, as its llm actions do: here the option `model` names it. The feed is computed
    # while the prompt is built: its request comes first.
    model = unique("llmfeed")
    llm.script(model, [turn('{"city": "Oslo", "sky": "snow"}'),
                       turn(final("$forecast.sky in $forecast.city"))])
    _, log = run_agent(store, broker, "llm_feeder", "what will the weather be?", model)
    assert log[-1]["type"] == "job_completed", log[-1]
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
    assert one(log, "response_end")["text"] == "snow in Oslo"
    assert not [e for e in of(log, "warning") if e["data"].get("kind") == "feed_failed"]


def test_a_cached_feed_is_shared_by_the_jobs_of_an_agent_until_its_ttl_runs_out(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    # The source, count_calls, counts its runs in the workspace of the job that runs it, and
    # names that job in its value. The feed id is new to this run: nothing is cached under it
    # yet (the cache is per tenant, agent, feed id and source, and outlives the jobs).
    feed_id = f"tally_{uuid.uuid4().hex[:8]}"
    feed = {"id": feed_id, "cache_ttl": 600,
            "source": {"type": "tool", "name": "count_calls", "params": {"key": "tally"}}}
    first, second = unique("cache1"), unique("cache2")
    llm.script(first, [turn(act("add", "add_context_feed", feed, kind="internal")),
                       turn(final("one"))])
    llm.script(second, [turn(act("add", "add_context_feed", feed, kind="internal")),
                        turn(act("nap", "sleep", {"seconds": 0})),
                        turn(final("two"))])

    def calls_in(job_id: str) -> int:
        counter = get_settings().workspace_root / job_id / ".count_calls/tally.count"
        return int(Path(counter).read_text()) if Path(counter).exists() else 0

    job1, log = run_agent(store, broker, "feed_lab", "go", first)
    assert log[-1]["type"] == "job_completed", log[-1]
    made = {"key": "tally", "calls": 1, "job": job1}
    assert one(log, "action_completed", "add")["result"]["value"] == made
    assert feed_value(user_text(llm, first, 1), feed_id) == made
    assert calls_in(job1) == 1  # its second prompt took the cached value

    job2 = jobs.submit_agent(store, "feed_lab", "go", options=JobOptions(model=second))
    while not broker.messages(dispatch.ACTION_TASK):  # its second turn sends the nap
        assert broker.step() is not None, "the nap was never sent"
    # another job of the agent gets the value job 1 made, and the source does not run for it
    assert one(events(store, job2), "action_completed", "add")["result"]["value"] == made
    assert feed_value(user_text(llm, second, 1), feed_id) == made
    (cached,) = store.redis.scan_iter(match=f"*{feed_id}*")
    store.redis.delete(cached)  # while it naps, the TTL runs out
    broker.join()
    log = events(store, job2)
    assert log[-1]["type"] == "job_completed", log[-1]
    # after the nap the TTL has run out: its next prompt computes the feed again
    assert feed_value(user_text(llm, second, 2), feed_id) == {"key": "tally", "calls": 1,
                                                               "job": job2}
    assert (calls_in(job1), calls_in(job2)) == (1, 1)


def test_a_run_time_feed_obeys_the_agents_lists(store: Store, broker: StubBroker,
                                                llm: FakeLLM) -> None:
    """A model cannot reach through a feed what its manifest does not let it call."""
    model = unique("sneaky")
    code = {"id": "sneaky", "source": {"type": "tool", "name": "python",
                                       "params": {"code": "print(6 * 7 * 1000003)"}}}
    flow = {"id": "flow", "source": {"type": "workflow", "name": "diamond", "params": {"x": 1}}}
    llm.script(model, [turn(act("a", "add_context_feed", code, mode="async", kind="internal")
                            + act("b", "add_context_feed", flow, mode="async", kind="internal")),
                       turn(final("done"))])
    _, log = run_agent(store, broker, "feeder", "go", model)  # tools: echo, sleep, fail
    assert log[-1]["type"] == "job_completed", log[-1]
    assert one(log, "action_failed", "a")["error"].startswith(
        "context feed 'sneaky': tool 'python' is not available to agent 'feeder'")
    assert one(log, "action_failed", "b")["error"] == (
        "context feed 'flow': workflow 'diamond' is not available to agent 'feeder'")
    prompt = user_text(llm, model, 1)  # the refusals are fed back; no feed was added
    assert '<context_feed id="sneaky">' not in prompt and '<context_feed id="flow">' not in prompt
    assert str(6 * 7 * 1000003) not in json.dumps(log)  # the code never ran
    assert [m for m in broker.sent if m.name == dispatch.INVOKE_TASK
            and m.args[1]["name"] == "python"] == []  # nor was it sent


def test_feeds_share_a_cache_only_with_the_same_source(store: Store, broker: StubBroker,
                                                       llm: FakeLLM) -> None:
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
        _, log = run_agent(store, broker, "feed_lab", "go", model)
        assert log[-1]["type"] == "job_completed", log[-1]
        values.append(one(log, "action_completed", "add")["result"]["value"])
    assert values == ["ship it", "hold it", "tiny ttl"]


def test_an_llm_feed_in_a_document_asks_the_document_model(store: Store, broker: StubBroker,
                                                           llm: FakeLLM) -> None:
    llm.script("documents", [turn("a summary")])
    feed = {"id": "summary", "source": {"type": "llm", "name": "summarize",
                                        "params": {"prompt": "the logs"}}}
    doc = act("add", "add_context_feed", feed, kind="internal") + "<response>$summary</response>"
    job_id = jobs.submit_document(store, doc)
    broker.join()
    log = events(store, job_id)
    assert log[-1]["type"] == "job_completed", log[-1]
    assert one(log, "response_end")["text"] == "a summary"
