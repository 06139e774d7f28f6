"""The fake model servers' rate limits (tests.fake_llm.RateLimit), over real HTTP: the sliding
window admits N requests and refuses the next with a 429, `retry-after` and the provider's
rate-limit headers, frees again once its oldest request leaves it; `max_in_flight` refuses a
request while held streams are open; refused requests take no scripted turn; the bookkeeping
(`refused`, `admitted`, `max_in_flight_seen`) and the default turn supply (`script_default`).
Streams are held by events (`Turn.holds`) and the window is waited on by polling its state,
never by asserting how long anything took."""

from __future__ import annotations

import datetime
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests import fake_anthropic, fake_llm
from tests.fake_anthropic import FakeAnthropic
from tests.fake_llm import FakeLLM, RateLimit, _duration

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "Say hello."}]
DEADLINE_S = 10.0  # a backstop for waits on state: never reached unless something is broken

OPENAI_REQUESTS = {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                   "x-ratelimit-reset-requests"}
OPENAI_TOKENS = {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                 "x-ratelimit-reset-tokens"}
ANTHROPIC_REQUESTS = {"anthropic-ratelimit-requests-limit",
                      "anthropic-ratelimit-requests-remaining",
                      "anthropic-ratelimit-requests-reset"}
ANTHROPIC_TOKENS = {f"anthropic-ratelimit-{kind}-{part}" for kind in ("tokens", "input-tokens")
                    for part in ("limit", "remaining", "reset")}


# -- the two providers, behind one interface ----------------------------------------------------


@dataclass
class Api:
    """One fake provider: how to make it, ask it, and read its answers and headers."""

    name: str
    make: Callable[..., FakeLLM]
    turn: Callable[..., Any]  # the provider's Turn
    path: str
    headers: dict[str, str]
    request_headers: set[str]  # the rate-limit header names with requests_per_window
    token_headers: set[str]  # and with tokens_per_window
    limit_requests: str
    remaining_requests: str
    remaining_tokens: str
    reset_requests: str

    def server(self, **kw: Any) -> FakeLLM:
        """The server; each answer closes its connection unless asked otherwise (the next
        request on a kept-alive connection waits out the fake's small writes: ~40 ms each)."""
        kw.setdefault("keep_alive", False)
        return self.make(**kw)

    def body(self, model: str, *, stream: bool = False, max_tokens: int | None = None
             ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": MESSAGES, "stream": stream}
        if self.name == "anthropic":
            body["max_tokens"] = max_tokens if max_tokens is not None else 64
        elif max_tokens is not None:
            body["max_tokens"] = max_tokens
        return body

    def post(self, client: httpx.Client, server: FakeLLM, model: str, **kw: Any
             ) -> httpx.Response:
        return client.post(server.url + self.path, json=self.body(model, **kw),
                           headers=self.headers)

    def text(self, response: httpx.Response) -> str:
        payload = response.json()
        if self.name == "anthropic":
            return "".join(b["text"] for b in payload["content"] if b["type"] == "text")
        return payload["choices"][0]["message"]["content"]

    def held(self, release: threading.Event) -> Any:
        """A turn whose stream stops after its first token (OpenAI) or block (Anthropic)
        until `release` is set."""
        return self.turn(text="abcdefgh", chunk_chars=4, holds={0: release})

    def cost(self, max_tokens: int) -> int:
        """A request's tokens as the fake counts them against `tokens_per_window`."""
        prompt = [None, MESSAGES] if self.name == "anthropic" else MESSAGES
        return math.ceil(len(json.dumps(prompt)) / 4) + max_tokens

    def check_refusal(self, response: httpx.Response, kind: str) -> None:
        """A 429 with the provider's error body for a `kind` ("requests"/"tokens") limit."""
        assert response.status_code == 429, response.text
        payload = response.json()
        if self.name == "anthropic":
            assert payload["type"] == "error"
            assert payload["error"]["type"] == "rate_limit_error"
            assert response.headers["request-id"].startswith("req_")
        else:
            assert payload["error"]["code"] == "rate_limit_exceeded"
            assert payload["error"]["type"] == kind
        assert payload["error"]["message"]


OPENAI = Api("openai", FakeLLM, fake_llm.Turn, "/chat/completions", {},
             OPENAI_REQUESTS, OPENAI_TOKENS, "x-ratelimit-limit-requests",
             "x-ratelimit-remaining-requests",
             "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests")
ANTHROPIC = Api("anthropic", FakeAnthropic, fake_anthropic.Turn, "/messages",
                {"anthropic-version": "2023-06-01"}, ANTHROPIC_REQUESTS, ANTHROPIC_TOKENS,
                "anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-requests-reset")


def settled(server: Any, model: str, timeout: float = 10.0) -> list[str]:
    """The model's outcomes once none is still being answered: the server records one after
    its last write, which the client may have read already (the deadline is a backstop)."""
    deadline = time.monotonic() + timeout
    while "streaming" in server.outcomes(model) and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.outcomes(model)


@pytest.fixture(params=[OPENAI, ANTHROPIC], ids=lambda api: api.name)

def api(request: pytest.FixtureRequest) -> Api:
    return request.param


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=DEADLINE_S) as c:
        yield c


def limit_headers(response: httpx.Response) -> dict[str, str]:
    """The rate-limit headers of an answer (lower-case names)."""
    return {k.lower(): v for k, v in response.headers.items() if "ratelimit" in k.lower()}


def seconds(duration: str) -> float:
    """An OpenAI reset duration (`12ms`, `1.5s`, `6m0s`, `1h2m3s`) in seconds."""
    if duration.endswith("ms"):
        return int(duration[:-2]) / 1000
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(\d+(?:\.\d+)?)s", duration)
    assert match, duration
    hours, minutes, secs = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "the state waited for never came"
        time.sleep(0.01)


# -- the window ---------------------------------------------------------------------------------


def test_the_window_admits_n_and_refuses_the_next(api: Api, client: httpx.Client) -> None:
    limit = RateLimit(requests_per_window=2, window_s=60)
    with api.server(rate_limit=limit, keep_alive=True) as server:
        server.script("m", [api.turn(text="one"), api.turn(text="two"), api.turn(text="three")])
        answers = [api.post(client, server, "m") for _ in range(3)]
        assert server.connections == 1  # one kept-alive connection, the 429 included

        assert [r.status_code for r in answers[:2]] == [200, 200]
        assert [api.text(r) for r in answers[:2]] == ["one", "two"]
        for response, remaining in zip(answers, ["1", "0", "0"], strict=True):
            assert set(limit_headers(response)) == api.request_headers
            assert response.headers[api.limit_requests] == "2"
            assert response.headers[api.remaining_requests] == remaining
        refused = answers[2]
        api.check_refusal(refused, "requests")
        assert refused.headers["retry-after"] == "1"
        assert "retry-after" not in answers[0].headers

        reset = refused.headers[api.reset_requests]
        if api is OPENAI:  # the time until the window frees a request: within the window
            assert 0 < seconds(reset) <= 60
        else:  # RFC 3339: when the window is wholly free again, within a minute from now
            at = datetime.datetime.fromisoformat(reset)
            now = datetime.datetime.now(datetime.UTC)
            assert at.tzinfo is not None
            assert now < at <= now + datetime.timedelta(seconds=61)

        assert server.refused("m") == 1
        assert server.remaining("m") == 1  # the refused request took no turn
        assert settled(server, "m") == ["complete", "complete", "rate_limited"]
        admitted = server.admitted("m")
        assert len(admitted) == 2
        assert all(finished is not None and finished >= at for at, finished in admitted)


def test_the_window_frees_after_window_s(api: Api, client: httpx.Client) -> None:
    window = RateLimit(requests_per_window=2, window_s=0.3)
    with api.server(rate_limit=window) as server:
        server.script_default("m", lambda body: api.turn(text="ok"))
        assert [api.post(client, server, "m").status_code for _ in range(2)] == [200, 200]
        statuses: list[int] = []
        deadline = time.monotonic() + DEADLINE_S
        while not statuses or statuses[-1] != 200:  # the state: until one more is admitted
            assert time.monotonic() < deadline, "the window never freed"
            response = api.post(client, server, "m")
            statuses.append(response.status_code)
            if response.status_code == 429:
                api.check_refusal(response, "requests")
                time.sleep(0.01)

        assert set(statuses[:-1]) <= {429}
        assert server.refused("m") == len(statuses) - 1
        admitted = [at for at, _ in server.admitted("m")]
        assert len(admitted) == 3
        # the sliding window: the third is admitted only once the first has left the window
        assert admitted[2] - admitted[0] >= window.window_s
        assert settled(server, "m") == ["complete"] * 2 + ["rate_limited"] * (
            len(statuses) - 1) + ["complete"]


def test_each_model_has_its_own_window_and_a_model_can_be_limited_alone(
        client: httpx.Client) -> None:
    with FakeLLM(rate_limit=RateLimit(requests_per_window=1, window_s=60),
                 keep_alive=False) as server:
        for model in ("a", "b", "c"):
            server.script_default(model, lambda body: fake_llm.Turn(text=body["model"]))
        server.limit("c", None)  # c: no limit
        assert OPENAI.post(client, server, "a").status_code == 200
        assert OPENAI.post(client, server, "a").status_code == 429
        assert OPENAI.text(OPENAI.post(client, server, "b")) == "b"
        unlimited = [OPENAI.post(client, server, "c") for _ in range(3)]
        assert [r.status_code for r in unlimited] == [200] * 3
        assert limit_headers(unlimited[0]) == {}
        assert (server.refused("a"), server.refused("b"), server.refused("c")) == (1, 0, 0)


def test_refused_requests_take_no_turn_and_the_limit_can_be_lifted(
        api: Api, client: httpx.Client) -> None:
    with api.server() as server:
        server.limit("m", RateLimit(requests_per_window=1, window_s=60, retry_after_s=2.5))
        server.script("m", [api.turn(text="first"), api.turn(text="second")])
        server.script("other", [api.turn(text="free")])
        assert api.text(api.post(client, server, "m")) == "first"
        refusals = [api.post(client, server, "m") for _ in range(3)]
        for response in refusals:
            api.check_refusal(response, "requests")
            assert response.headers["retry-after"] == "3"  # 2.5 s rounded up
        assert server.remaining("m") == 1
        assert server.refused("m") == 3
        assert api.text(api.post(client, server, "other")) == "free"  # not limited

        server.limit("m", None)
        lifted = api.post(client, server, "m")
        assert api.text(lifted) == "second"
        assert limit_headers(lifted) == {}
        assert server.remaining("m") == 0
        assert len(server.admitted("m")) == 2


def test_no_retry_after_when_asked_for_none(api: Api, client: httpx.Client) -> None:
    with api.server(rate_limit=RateLimit(requests_per_window=0, retry_after_s=None)) as server:
        response = api.post(client, server, "m")
        api.check_refusal(response, "requests")
        assert "retry-after" not in response.headers
        assert response.headers[api.remaining_requests] == "0"
        assert server.admitted("m") == []


def test_a_burst_is_admitted_exactly_up_to_the_limit(api: Api, client: httpx.Client) -> None:
    with api.server(rate_limit=RateLimit(requests_per_window=5, window_s=60)) as server:
        server.script_default("m", lambda body: api.turn(text="ok"))
        with ThreadPoolExecutor(max_workers=5) as pool:  # the server's listen backlog: 5
            statuses = list(pool.map(lambda _: api.post(client, server, "m").status_code,
                                     range(20)))
        assert sorted(statuses) == [200] * 5 + [429] * 15
        assert server.refused("m") == 15
        assert len(server.admitted("m")) == 5
        assert sorted(settled(server, "m")) == ["complete"] * 5 + ["rate_limited"] * 15


# -- tokens -------------------------------------------------------------------------------------


def test_tokens_per_window_counts_the_prompt_and_max_tokens(
        api: Api, client: httpx.Client) -> None:
    cost = api.cost(max_tokens=100)
    budget = 2 * cost + cost // 2  # room for two requests, not three
    with api.server(rate_limit=RateLimit(tokens_per_window=budget, window_s=60)) as server:
        server.script_default("m", lambda body: api.turn(text="ok"))
        answers = [api.post(client, server, "m", max_tokens=100) for _ in range(3)]

        assert [r.status_code for r in answers[:2]] == [200, 200]
        api.check_refusal(answers[2], "tokens")
        for response, remaining in zip(answers, [budget - cost, budget - 2 * cost,
                                                 budget - 2 * cost], strict=True):
            assert set(limit_headers(response)) == api.token_headers
            assert response.headers[api.remaining_tokens] == str(remaining)
        if api is ANTHROPIC:
            headers = limit_headers(answers[1])
            assert headers["anthropic-ratelimit-input-tokens-remaining"] == str(budget - 2 * cost)
            assert headers["anthropic-ratelimit-tokens-limit"] == str(budget)
        else:
            assert answers[1].headers["x-ratelimit-limit-tokens"] == str(budget)
            assert 0 < seconds(answers[2].headers["x-ratelimit-reset-tokens"]) <= 60
        # a smaller request still fits in what is left
        assert api.post(client, server, "m", max_tokens=1).status_code == 200


def test_both_limits_send_both_sets_of_headers(api: Api, client: httpx.Client) -> None:
    limit = RateLimit(requests_per_window=10, tokens_per_window=10_000, window_s=60)
    with api.server(rate_limit=limit) as server:
        server.script("m", [api.turn(text="ok")])
        response = api.post(client, server, "m")
        assert response.status_code == 200
        assert set(limit_headers(response)) == api.request_headers | api.token_headers


# -- requests in flight -------------------------------------------------------------------------


def test_max_in_flight_refuses_while_a_held_stream_is_open(
        api: Api, client: httpx.Client) -> None:
    release = threading.Event()
    with api.server(rate_limit=RateLimit(max_in_flight=1, retry_after_s=None)) as server:
        server.script("m", [api.held(release), api.turn(text="after")])
        url = server.url + api.path
        with client.stream("POST", url, json=api.body("m", stream=True),
                           headers=api.headers) as held:
            assert held.status_code == 200
            lines = held.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it is being answered
            assert server.in_flight("m") == 1

            with httpx.Client(timeout=DEADLINE_S) as other:  # another connection
                refused = other.post(url, json=api.body("m", stream=True), headers=api.headers)
            assert refused.status_code == 429
            assert refused.headers["content-type"] == "application/json"  # not a stream
            assert "concurrent" in refused.json()["error"]["message"]
            assert "retry-after" not in refused.headers
            assert limit_headers(refused) == {}  # no window limit: no window headers
            assert server.remaining("m") == 1  # the refused request took no turn

            release.set()
            rest = "".join(lines)
        assert "efgh" in rest
        wait_for(lambda: server.in_flight("m") == 0)
        assert api.text(api.post(client, server, "m")) == "after"

    assert server.refused("m") == 1
    assert server.max_in_flight_seen("m") == 1
    assert [finished is not None for _, finished in server.admitted("m")] == [True, True]


def test_max_in_flight_seen_without_a_limit(api: Api, client: httpx.Client) -> None:
    releases = [threading.Event() for _ in range(3)]
    with api.server() as server, httpx.Client(timeout=DEADLINE_S) as c2, \
            httpx.Client(timeout=DEADLINE_S) as c3:
        server.script("m", [api.held(r) for r in releases])
        url = server.url + api.path
        streams = [c.stream("POST", url, json=api.body("m", stream=True), headers=api.headers)
                   for c in (client, c2, c3)]
        try:
            readers = []
            for stream in streams:
                response = stream.__enter__()
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                readers.append(lines)
            assert server.in_flight("m") == 3
            assert [finished for _, finished in server.admitted("m")] == [None] * 3
            for release, lines in zip(releases, readers, strict=True):
                release.set()
                assert "efgh" in "".join(lines)
        finally:
            for release in releases:
                release.set()
            for stream in streams:
                stream.__exit__(None, None, None)
        wait_for(lambda: server.in_flight("m") == 0)
        assert server.max_in_flight_seen("m") == 3
        assert server.refused("m") == 0
        assert all(finished is not None and finished >= at
                   for at, finished in server.admitted("m"))


# -- the default turn supply --------------------------------------------------------------------


def test_the_default_turn_supply(api: Api, client: httpx.Client) -> None:
    seen: list[dict[str, Any]] = []

    def make(body: dict[str, Any]) -> Any:
        seen.append(body)
        return api.turn(text=f"default {len(seen)}: {body['messages'][-1]['content']}")

    with api.server() as server:
        server.script("m", [api.turn(text="scripted")])
        server.script_default("m", make)
        texts = [api.text(api.post(client, server, "m")) for _ in range(3)]
        assert texts == ["scripted", "default 1: Say hello.", "default 2: Say hello."]
        assert [body["model"] for body in seen] == ["m", "m"]
        assert settled(server, "m") == ["complete"] * 3

        without = api.post(client, server, "other")  # no default: the 400 as before
        assert without.status_code == 400
        assert "no scripted turn left" in without.text
        server.script_default("m", None)
        assert api.post(client, server, "m").status_code == 400
        assert server.outcomes("m")[-1] == "no_turn"


def test_the_default_models_are_listed(client: httpx.Client) -> None:
    with FakeLLM(keep_alive=False) as server:
        server.script_default("made", lambda body: fake_llm.Turn(text="x"))
        server.script("scripted", [fake_llm.Turn(text="y")])
        listed = client.get(server.url + "/models").json()["data"]
        assert [m["id"] for m in listed] == ["made", "scripted"]


# -- formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "written"), [
    (0, "0s"), (0.0004, "1ms"), (0.012, "12ms"), (0.3, "300ms"), (1, "1s"), (1.5, "1.5s"),
    (59.999, "59.999s"), (60, "1m0s"), (360, "6m0s"), (86.4, "1m26.4s"),
    (3723.5, "1h2m3.5s"), (-1, "0s")])
def test_reset_durations_are_written_as_openai_writes_them(value: float, written: str) -> None:
    assert _duration(value) == written
    assert seconds(written) == pytest.approx(max(0, value), abs=0.001)


def test_rate_limit_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RateLimit(window_s=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        RateLimit(max_in_flight=-1)
