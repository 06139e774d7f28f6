"""Model endpoints' shared limits (cortex_worker.llm.limits, lua/model_take.lua and
lua/model_give.lua) on a real Redis: slots in flight, requests and tokens per minute, the
pause after a provider's 429, the provider's remaining count, whose turn it is across tenants,
and a request through the gateway that waits out a 429 without spending `max_retries`.

Every assertion is on the state the scripts keep and the order things happened in, never on
how long a wait took."""

from __future__ import annotations

import datetime
import threading
import uuid
from typing import Any

import httpx
import pytest

from cortex_worker.actions import dispatch
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.options import JobOptions
from cortex_worker.llm import gateway, limits
from cortex_worker.llm.config import ModelConfig, ModelLimits
from cortex_worker.observability.metrics import CortexCollector
from cortex_worker.store.keys import model_keys
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from tests.engine.helpers import action, events, of, one, status
from tests.fake_llm import FakeLLM, Turn


def take(store: Store, holder: str, tenant: str = "acme", *, rpm: int | None = None,
         tpm: int | None = None, concurrent: int | None = None,
         tokens: int = 10) -> tuple[bool, float | None, str]:
    return store.take_model_slot("ep", holder, tenant, lease_s=60, limits=(rpm, tpm, concurrent),
                                 tokens=tokens, stale_s=10)[:3]


def give(store: Store, holder: str, **answer: Any) -> float:
    """The answer's head (what it says of the limits, if anything), then the slot given back
    with its tokens; returns the pause in force."""
    slot = {k: answer.pop(k) for k in ("taken", "used", "tokens_per_minute", "ceiling")
            if k in answer}
    pause = 0.0
    if answer:
        pause = store.model_answer("ep", **{"refused": False, "reset_s": None,
                                            "remaining": None, **answer})
    store.give_model_slot("ep", holder, **{"taken": 10, "used": None, "tokens_per_minute": None,
                                           "answered": not answer.get("refused"), **slot})
    return pause


def test_nothing_declared_takes_at_once(store: Store) -> None:
    assert [take(store, f"h{i}")[0] for i in range(20)] == [True] * 20
    assert store.model_use("ep")["in_flight"] == 20


def test_max_concurrent_holds_the_next_until_one_gives_back(store: Store) -> None:
    assert take(store, "a", concurrent=2)[0] and take(store, "b", concurrent=2)[0]
    assert take(store, "c", concurrent=2) == (False, None, "max_concurrent")
    use = store.model_use("ep")
    assert (use["in_flight"], use["waiting"]) == (2, 1)
    give(store, "a")
    assert take(store, "c", concurrent=2)[0]
    assert take(store, "c", concurrent=2)[0]  # taking again what one holds is a no-op
    assert store.model_use("ep")["in_flight"] == 2


def test_requests_per_minute_spaces_requests_out(store: Store) -> None:
    assert take(store, "a", rpm=60)[0]
    taken, wait_s, reason = take(store, "b", rpm=60)
    assert not taken and reason == "requests_per_minute"
    assert wait_s is not None and 0 < wait_s <= 1.0  # one request a second


def test_tokens_per_minute_waits_for_the_bucket_and_usage_corrects_it(store: Store) -> None:
    # 600 a minute: a bucket of 100 (ten seconds' worth), filling at 10 a second
    assert take(store, "a", tpm=600, tokens=90)[0]
    taken, wait_s, reason = take(store, "b", tpm=600, tokens=90)
    assert not taken and reason == "tokens_per_minute" and wait_s is not None and wait_s > 1
    give(store, "a", taken=90, used=10, tokens_per_minute=600)  # it used far fewer
    assert take(store, "b", tpm=600, tokens=90)[0]


def test_a_429_pauses_every_request_and_halves_what_may_fly(store: Store) -> None:
    for holder in ("a", "b", "c", "d"):
        assert take(store, holder)[0]
    pause = give(store, "a", refused=True, reset_s=30)
    assert 29 < pause <= 30
    taken, wait_s, reason = take(store, "e")
    assert not taken and reason == "paused" and wait_s is not None and wait_s > 29
    use = store.model_use("ep")
    assert use["rate_limited"] == 1 and use["adaptive_max_concurrent"] == 2
    assert use["paused_for_s"] > 29


def test_successes_grow_the_adaptive_limit_back_until_it_is_dropped(store: Store) -> None:
    assert take(store, "a")[0] and take(store, "b")[0]
    give(store, "a", refused=True, reset_s=0.0)  # no pause left, but the limit is halved
    assert store.model_use("ep")["adaptive_max_concurrent"] == 1
    for i in range(40):
        give(store, "b" if i == 0 else f"x{i}", ceiling=4)
        assert take(store, f"x{i + 1}")[0]
    assert store.model_use("ep")["adaptive_max_concurrent"] is None


def test_the_providers_remaining_count_holds_requests_before_it_refuses(store: Store) -> None:
    assert take(store, "a")[0]
    give(store, "a", remaining=1, reset_s=30)
    assert take(store, "b")[0]  # the one that remains
    taken, wait_s, reason = take(store, "c")
    assert not taken and reason == "remaining" and wait_s is not None and wait_s > 29


def test_a_remaining_count_leaves_out_the_requests_sent_after_it(store: Store) -> None:
    """The provider said 3 remain when it answered request 1; requests 2 and 3 had been sent
    meanwhile, so only one more may go before its reset."""
    numbers = [store.take_model_slot("ep", h, "acme", lease_s=60, limits=(None, None, None),
                                     tokens=1, stale_s=10)[3] for h in ("r1", "r2", "r3")]
    assert numbers == [1, 2, 3]
    give(store, "r1", reset_s=30, remaining=3, number=1)
    assert take(store, "r4")[0]
    assert take(store, "r5")[2] == "remaining"


def test_once_the_providers_count_has_reset_one_request_finds_the_new_one(
        store: Store) -> None:
    """The provider's window reset since it said 1 remained: one request goes (a probe) and
    the others wait for its answer, which brings the new count back."""
    assert take(store, "a")[0]
    give(store, "a", remaining=1, reset_s=0.0)  # its window has reset already
    assert take(store, "probe")[0]
    assert take(store, "other")[2] == "remaining"
    give(store, "probe", remaining=5, reset_s=30)
    assert take(store, "other")[0]


def test_waiters_are_served_in_turn_by_tenant(store: Store) -> None:
    """acme holds the one slot and queues five more requests before globex queues one: when
    the slot frees, globex's goes first (acme was served last), then acme's in arrival order."""
    assert take(store, "running", "acme", concurrent=1)[0]
    for i in range(5):
        assert not take(store, f"acme{i}", "acme", concurrent=1)[0]
    assert not take(store, "globex0", "globex", concurrent=1)[0]
    order = []
    holder = "running"
    waiting = [f"acme{i}" for i in range(5)] + ["globex0"]
    while waiting:
        give(store, holder)
        granted = [w for w in waiting if take(store, w, w.rstrip("0123456789"),
                                              concurrent=1)[0]]
        assert len(granted) == 1, granted
        holder = granted[0]
        waiting.remove(holder)
        order.append(holder)
    assert order == ["globex0", "acme0", "acme1", "acme2", "acme3", "acme4"]


def test_a_waiter_that_stopped_asking_loses_its_place(store: Store) -> None:
    assert take(store, "running", concurrent=1)[0]
    assert not take(store, "gone", concurrent=1)[0]
    give(store, "running")
    assert not store.take_model_slot("ep", "alive", "acme", lease_s=60, limits=(None, None, 1),
                                     tokens=1, stale_s=10)[0]  # "gone" is first in line
    store.redis.hset(model_keys("ep").waiters, "gone", "acme|1")  # it last asked long ago
    assert store.take_model_slot("ep", "alive", "acme", lease_s=60, limits=(None, None, 1),
                                 tokens=1, stale_s=10)[0]


@pytest.mark.parametrize(("headers", "expected"), [
    ({"retry-after": "2"}, (2.0, None)),
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}, (1.0, 0)),
    ({"x-ratelimit-remaining-requests": "7", "x-ratelimit-reset-requests": "6m0s",
      "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "250ms"}, (360.0, 0)),
    ({"x-ratelimit-remaining-requests": "7", "x-ratelimit-reset-requests": "20ms"}, (0.02, 7)),
    ({}, (None, None)),
])
def test_provider_headers_say_when_the_limit_resets(headers: dict[str, str],
                                                     expected: tuple[float | None, int | None]
                                                     ) -> None:
    reset, remaining = limits.provider_limits(httpx.Headers(headers))
    assert remaining == expected[1]
    assert (reset is None) == (expected[0] is None)
    if reset is not None:
        assert reset == pytest.approx(expected[0], abs=0.01)


def test_anthropic_resets_are_times() -> None:
    soon = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)).isoformat()
    reset, remaining = limits.provider_limits(httpx.Headers({
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": soon}))
    assert remaining == 0 and reset is not None and 28 < reset <= 30


def test_a_request_waits_out_a_429_without_spending_its_retries(store: Store) -> None:
    """max_retries 0, and the provider refuses the first request with Retry-After: 1: the
    request waits the pause out (the job hears why) and the second answer is the result."""
    waits: list[tuple[str, str]] = []
    with FakeLLM() as llm:
        llm.script("m", [Turn(fail_status=429, headers={"Retry-After": "1"}),
                         Turn(text="<response final>ok</response>")])
        config = ModelConfig(base_url=llm.url, model="m", api_key_env=None, max_retries=0,
                             limits=ModelLimits(max_concurrent=2))
        caller = limits.Caller(store, "job1", "acme",
                               on_wait=lambda e, reason, _: waits.append((e, reason)))
        with limits.calling(caller):
            text, _ = gateway.complete(config, [{"role": "user", "content": "hi"}])
        assert text == "<response final>ok</response>"
        assert len(llm.requests("m")) == 2
    assert waits == [(config.endpoint(), "paused")]
    use = store.model_use(config.endpoint())
    assert {k: use[k] for k in ("in_flight", "waiting", "rate_limited", "requests", "waits")} \
        == {"in_flight": 0, "waiting": 0, "rate_limited": 1, "requests": 2, "waits": 1}


def test_without_a_caller_the_gateway_goes_straight_to_the_endpoint(store: Store) -> None:
    with FakeLLM() as llm:
        llm.script("m", [Turn(fail_status=429, headers={"Retry-After": "0"})])
        config = ModelConfig(base_url=llm.url, model="m", api_key_env=None, max_retries=0)
        with pytest.raises(Exception, match="429"):
            gateway.complete(config, [{"role": "user", "content": "hi"}])
    assert store.model_use(config.endpoint())["requests"] == 0


def test_concurrent_callers_never_exceed_max_concurrent(store: Store) -> None:
    """Eight threads, max_concurrent 2: the fake provider never sees more than two at once."""
    with FakeLLM() as llm:
        llm.script("m", [Turn(text="x" * 40, tokens_per_second=400) for _ in range(8)])
        config = ModelConfig(base_url=llm.url, model="m", api_key_env=None,
                             limits=ModelLimits(max_concurrent=2))
        errors: list[BaseException] = []
        lock = threading.Lock()
        flying, peak = [0], [0]
        original = limits.Held.answered

        def answered(held: limits.Held, response: httpx.Response) -> None:
            with lock:
                flying[0] += 1
                peak[0] = max(peak[0], flying[0])
            original(held, response)

        def give_back(held: limits.Held, _original=limits.Held.give_back) -> None:
            if not held.given:
                with lock:
                    flying[0] -= 1
            _original(held)

        def one(i: int) -> None:
            try:
                with limits.calling(limits.Caller(store, f"job{i}", "acme")):
                    gateway.complete(config, [{"role": "user", "content": str(i)}])
            except BaseException as exc:
                errors.append(exc)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(limits.Held, "answered", answered)
            patch.setattr(limits.Held, "give_back", give_back)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        assert errors == []
        assert len(llm.requests("m")) == 8
        assert peak[0] <= 2
    assert store.model_use(config.endpoint())["in_flight"] == 0


def test_a_turn_hands_its_thread_back_while_its_endpoint_is_paused(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """The provider refuses turn 1 with Retry-After: 30. The turn does not hold its thread for
    the pause: it hands the turn back (the job's log says why it waits) and a turn task is
    sent for when the pause ends. That task generates the turn from the same inputs, with no
    restart warning and no second `turn_started`, and the job completes."""
    model = f"engine-{uuid.uuid4().hex[:8]}"
    llm.script(model, [Turn(fail_status=429, headers={"Retry-After": "30"}),
                       Turn(text='<response final="true">done</response>')])
    job_id = jobs.submit_agent(store, "tester", "Say done.", options=JobOptions(model=model))
    broker.join(delayed=False)

    record = store.peek(job_id, "status", "turn_phase")
    assert record is not None and (record.status, record.turn_phase) == ("running", "yielded")
    waiting = one(events(store, job_id), "model_waiting")
    assert waiting["reason"] == "paused" and waiting["wait_s"] > limits.HOLD_S
    later = [m for m in broker.messages() if m.name == dispatch.TURN_TASK]
    assert len(later) == 1 and later[0].countdown is not None and later[0].countdown > limits.HOLD_S

    store.redis.hdel(model_keys(waiting["endpoint"]).state, "pause_until")  # the stub's time does not pass
    broker.join()
    log = events(store, job_id)
    assert status(store, job_id) == "completed"
    assert len(of(log, "turn_started")) == 1
    assert not [e for e in of(log, "warning") if e["data"].get("kind") == "turn_restarted"]
    assert len(llm.requests(model)) == 2


def test_a_ready_llm_action_waits_in_its_queue_while_its_endpoint_is_paused(
        store: Store, broker: StubBroker, llm: FakeLLM) -> None:
    """A provider's 429 paused the documents' model endpoint for 30 s. A ready `llm` action is
    not claimed meanwhile: it does not hold a worker slot for the pause (an llm action on
    another endpoint could use it). The job hears why (`model_waiting`, naming the action),
    the action's task is sent again for the pause's end, and then it runs once, as its first
    attempt, and the job completes."""
    llm.script("documents", [Turn(text="the answer")])
    asked = len(llm.requests("documents"))  # the fake model server serves the whole package
    doc = action("a", "summarise", {"text": "x"}).replace('type="tool"', 'type="llm"')
    # readiness dispatch: the stub runs a canvas eagerly, where a retry cannot wait (a canvas
    # step's wait is tests/integration/test_model_limits.py's)
    job_id = jobs.submit_document(store, doc, options=JobOptions(canvas=False))
    broker.step()  # the job's start: the action is registered and its task sent
    spec = store.spec(job_id, "a")
    assert spec is not None and spec["type"] == "llm"
    endpoint = ModelConfig.from_wire(spec["model"]).endpoint()
    assert store.model_answer(endpoint, refused=True, reset_s=30.0, remaining=None) > limits.HOLD_S

    broker.join(delayed=False)
    log = events(store, job_id)
    assert of(log, "action_started") == [] and len(llm.requests("documents")) == asked
    waiting = one(log, "model_waiting")
    assert (waiting["action_id"], waiting["endpoint"], waiting["reason"]) == ("a", endpoint, "paused")
    assert waiting["wait_s"] > limits.HOLD_S
    later = [m for m in broker.messages() if m.name == dispatch.ACTION_TASK]
    assert len(later) == 1 and later[0].countdown is not None and later[0].countdown > limits.HOLD_S
    assert store.spec(job_id, "a") == spec and status(store, job_id) == "running"

    store.redis.hdel(model_keys(endpoint).state, "pause_until")  # the stub's time does not pass
    broker.join()
    log = events(store, job_id)
    assert [e["data"]["attempt"] for e in of(log, "action_started")] == [1]
    assert one(log, "action_completed", "a")["result"] == "the answer"
    assert status(store, job_id) == "completed" and len(llm.requests("documents")) == asked + 1


def test_an_endpoint_out_of_the_providers_count_holds_llm_actions_until_its_reset(
        store: Store) -> None:
    """The provider's remaining count at 0 with a reset 20 s away is a known wait too (as
    lua/model_take.lua reads it); a short one is waited out in line."""
    config = ModelConfig(provider="openai", base_url="http://127.0.0.1:9", model="m")
    endpoint = config.endpoint()
    assert limits.known_wait(store, config) is None
    store.model_answer(endpoint, refused=False, reset_s=20.0, remaining=0)
    known = limits.known_wait(store, config)
    assert known is not None and known[:2] == (endpoint, "remaining") and known[2] > limits.HOLD_S
    store.redis.flushdb()
    store.model_answer(endpoint, refused=True, reset_s=limits.HOLD_S / 2, remaining=None)
    assert limits.known_wait(store, config) is None  # shorter than HOLD_S: waited in line


def test_metrics_count_each_endpoints_requests_refusals_and_waits(store: Store) -> None:
    with FakeLLM() as llm:
        llm.script("m", [Turn(fail_status=429, headers={"Retry-After": "0"}), Turn(text="ok")])
        config = ModelConfig(base_url=llm.url, model="m", api_key_env=None, max_retries=0)
        with limits.calling(limits.Caller(store, "job1", "acme")):
            gateway.complete(config, [{"role": "user", "content": "hi"}])
    samples = {(s.name, s.labels.get("endpoint")): s.value
               for family in CortexCollector(store.redis).collect() for s in family.samples}
    endpoint = config.endpoint()
    assert samples[("cortex_model_requests_total", endpoint)] == 2
    assert samples[("cortex_model_rate_limited_total", endpoint)] == 1
    assert samples[("cortex_model_in_flight", endpoint)] == 0
    assert samples[("cortex_model_waiting", endpoint)] == 0
