"""Model endpoints' limits, shared by every worker of the cluster (architecture.md: "shared
limits live in Redis, not in a process").

A request to a model endpoint first takes a slot (`slot`): within the endpoint's declared
`limits` (requests and tokens per minute, requests in flight) and any pause a provider's 429
started, all held in Redis (`Store.take_model_slot`, lua/model_take.lua), so every process on
every host counts the same requests. Waiters are served in turn by tenant, in arrival order
within one. Waiting is not a retry: it spends no `max_retries`.

The slot is given back with what the answer said (`Held.answered`, lua/model_give.lua): a 429
or 529 pauses every worker's requests to the endpoint until the provider's reset
(`Retry-After`, `x-ratelimit-reset-*`, `anthropic-ratelimit-*-reset`); a low remaining count
holds requests until its reset before the provider refuses any; and an adaptive concurrency
limit, halved at each refusal and grown again by successes, makes the end of a pause a trickle
rather than a storm.

The limiter applies where a caller is set (`calling`): the agent loop and `llm` actions set
one; a bare gateway call (a script, a unit test) goes straight to the endpoint.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.stream import ModelError, Usage, estimate_usage
from cortex_worker.store.state import Store

__all__ = ["HOLD_S", "Caller", "Held", "ModelBusy", "calling", "estimate_tokens",
           "known_wait", "provider_limits", "slot"]

POLL_S = 0.1
"""How often a request that waits for a slot in flight (or for its turn) asks again."""
STALE_S = 10.0
"""A waiter that has not asked for this long loses its place (its process died)."""
LEASE_S = 600.0
"""A slot in flight frees itself after this long if its holder never gives it back."""
ADAPTIVE_CEILING = 64
"""The adaptive concurrency limit is dropped once successes grow it this far."""
REFUSED_STATUS = frozenset({429, 529})
SPREAD_AFTER = frozenset({"paused", "remaining"})
"""Waits whose end many waiters share: each asks again a little apart."""
CHARS_PER_TOKEN = 4
HOLD_S = 5.0
"""A wait of known length longer than this is not spent in a worker's thread: an agent turn
hands its thread back (`Caller.hold_s`), and a ready `llm` action is not claimed until it ends
(`known_wait`)."""


class ModelBusy(Exception):
    """The endpoint has no slot for longer than the caller holds its thread: come back in
    `retry_in_s` (the caller hands its work back to the queue)."""

    def __init__(self, endpoint: str, reason: str, retry_in_s: float) -> None:
        super().__init__(f"model endpoint {endpoint} is busy ({reason}): "
                         f"retry in {retry_in_s:.1f} s")
        self.endpoint, self.reason, self.retry_in_s = endpoint, reason, retry_in_s


@dataclass(frozen=True)
class Caller:
    """Who asks for the model: the job's store, id and tenant, what to tell the job when its
    request must wait (`on_wait(endpoint, reason, wait_s or None)`), when waiting must give up
    (`deadline`, time.time(); the job's wall time), how long the caller may hold its thread
    waiting before it hands its work back (`hold_s`; None: wait in the thread), and the job's
    usage hooks (`before`, `on_usage`: jobs/usage.py)."""

    store: Store
    job_id: str
    tenant: str
    on_wait: Callable[[str, str, float | None], None] = lambda *_: None
    deadline: float | None = None
    hold_s: float | None = None
    before: Callable[[], None] = lambda: None
    """Called before each request (it may raise: the tenant's budget is spent)."""
    on_usage: Callable[[str, int, int], None] = lambda *_: None
    """Called with (endpoint, prompt tokens, completion tokens) after each answered request."""


_caller: ContextVar[Caller | None] = ContextVar("cortex_model_caller", default=None)
_noted: set[tuple[int, str]] = set()  # (store, endpoint) listed in the store's index already


@contextlib.contextmanager
def calling(caller: Caller) -> Iterator[Caller]:
    """Requests to model endpoints made in this block (this thread) take shared slots."""
    token = _caller.set(caller)
    try:
        yield caller
    finally:
        _caller.reset(token)


def estimate_tokens(body: dict[str, Any]) -> int:
    """A request's tokens before it is sent: its messages (and tools) at four characters a
    token, plus the completion it may write (`max_tokens`); corrected by the reported usage."""
    text = json.dumps([body.get("messages"), body.get("tools"), body.get("system")],
                      separators=(",", ":"), ensure_ascii=False, default=str)
    return len(text) // CHARS_PER_TOKEN + int(body.get("max_tokens") or 0)


# -- what a provider's answer says about its limits ------------------------------------------
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(value: str | None) -> float | None:
    """A reset as providers write it: seconds ("1", "0.5"), OpenAI's durations ("1s", "6m0s",
    "250ms"), or a time (RFC 3339, as Anthropic; or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parts = _DURATION.findall(value)
    if parts and "".join(n + u for n, u in parts) == value:
        return sum(float(n) * _UNITS[u] for n, u in parts)
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError):
            return None
    return max(0.0, when - time.time())


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(float(value))
    except ValueError:
        return None


def provider_limits(headers: httpx.Headers) -> tuple[float | None, int | None]:
    """(seconds until the provider's limit resets, requests it says remain until then), from
    `Retry-After` and OpenAI's `x-ratelimit-*` or Anthropic's `anthropic-ratelimit-*` headers:
    the reset of an exhausted dimension (requests or tokens) wins; None where they are silent."""
    remaining: int | None = None
    resets: list[float] = []
    for prefix, kinds in (("x-ratelimit-{}-{}", ("requests", "tokens")),
                          ("anthropic-ratelimit-{1}-{0}", ("requests", "tokens",
                                                           "input-tokens", "output-tokens"))):
        for kind in kinds:
            left = _int(headers.get(prefix.format("remaining", kind)))
            reset = _seconds(headers.get(prefix.format("reset", kind)))
            if kind == "requests" and left is not None:
                remaining = left if remaining is None else min(remaining, left)
                if reset is not None:
                    resets.append(reset)
            elif left is not None and left <= 0 and reset is not None:
                resets.append(reset)
                remaining = 0
    after = _seconds(headers.get("retry-after"))
    if after is not None:
        resets.append(after)
    return (max(resets) if resets else None), remaining


# -- slots --------------------------------------------------------------------------------
@dataclass
class Held:
    """A request's slot of an endpoint, taken by `slot`; give the answer's headers to
    `answered` and the reported usage to `used`."""

    caller: Caller
    config: ModelConfig
    endpoint: str
    holder: str
    taken: int
    number: int = 0
    """The request's number among the endpoint's: the provider's remaining count it brings
    back does not yet count those sent after it."""
    refused: bool = False
    status: int | None = None
    reset_s: float | None = None
    remaining: int | None = None
    usage: Usage | None = None
    deltas: int = 0
    """Text pieces streamed: with the prompt, the estimate of a generation cut short."""
    messages: list[dict[str, Any]] = field(default_factory=list, repr=False)
    given: bool = field(default=False, repr=False)

    def answered(self, response: httpx.Response) -> None:
        """The answer's head arrived: what it says of the provider's limits counts at once."""
        self.status = response.status_code
        self.refused = response.status_code in REFUSED_STATUS
        self.reset_s, self.remaining = provider_limits(response.headers)
        if self.refused or self.remaining is not None:
            self.caller.store.model_answer(self.endpoint, refused=self.refused,
                                           reset_s=self.reset_s, remaining=self.remaining,
                                           number=self.number)

    def used(self, usage: Usage) -> None:
        self.usage = usage

    def give_back(self) -> None:
        if self.given:
            return
        self.given = True
        limits = self.config.limits
        if self.status is not None and self.status < 300:
            if self.usage is None:  # closed before the endpoint sent its counts
                self.usage = estimate_usage(self.messages, self.deltas)
            self.caller.on_usage(self.endpoint, self.usage.prompt_tokens,
                                 self.usage.completion_tokens)
        self.caller.store.give_model_slot(
            self.endpoint, self.holder, taken=self.taken,
            used=self.usage.total_tokens if self.usage else None,
            tokens_per_minute=limits.tokens_per_minute if limits else None,
            answered=self.status is not None and self.status < 300,
            ceiling=(limits.max_concurrent if limits and limits.max_concurrent
                     else ADAPTIVE_CEILING))


def _take(caller: Caller, config: ModelConfig, endpoint: str, holder: str,
          tokens: int) -> tuple[bool, float | None, str, int]:
    limits = config.limits
    declared = ((limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent)
                if limits else (None, None, None))
    return caller.store.take_model_slot(endpoint, holder, caller.tenant, lease_s=LEASE_S,
                                        limits=declared, tokens=tokens, stale_s=STALE_S)


def known_wait(store: Store, config: ModelConfig) -> tuple[str, str, float] | None:
    """(endpoint, reason, seconds) when every request to `config`'s endpoint must wait longer
    than `HOLD_S` now, for a reason that holds for all of them: a pause after a refusal
    (`paused`), or the provider's count spent until its reset (`remaining`). None otherwise
    (a request may still wait its turn in line, in its thread)."""
    endpoint = config.endpoint()
    wait = store.model_known_wait(endpoint)
    if wait is None or wait[1] <= HOLD_S:
        return None
    return endpoint, wait[0], wait[1]


@contextlib.contextmanager
def slot(config: ModelConfig, body: dict[str, Any]) -> Iterator[Held | None]:
    """Wait for a request slot of `config`'s endpoint (None when no caller is set: no limits
    apply), and give it back when the block ends. Raises `ModelBusy` when a wait of known
    length (a pause, a rate) is longer than the caller's `hold_s` (a wait for a slot in flight
    is as long as others' requests: it stays in line), and a final `ModelError` when waiting
    would outlast the caller's deadline."""
    caller = _caller.get()
    if caller is None:
        yield None
        return
    caller.before()
    endpoint = config.endpoint()
    if (id(caller.store), endpoint) not in _noted:
        caller.store.note_model_endpoint(endpoint)
        _noted.add((id(caller.store), endpoint))
    holder = f"{caller.job_id}:{uuid.uuid4().hex[:12]}"
    tokens = estimate_tokens(body)
    started = time.monotonic()
    told = ""
    while True:
        taken, wait_s, reason, number = _take(caller, config, endpoint, holder, tokens)
        if taken:
            break
        if not told:  # the job hears of a wait once, with its first reason
            caller.store.count_model_wait(endpoint)
            caller.on_wait(endpoint, reason, wait_s)
            told = reason
        pause = POLL_S * random.uniform(0.5, 1.5) if wait_s is None else wait_s
        waited = time.monotonic() - started
        if caller.deadline is not None and time.time() + pause > caller.deadline:
            caller.store.leave_model_line(endpoint, holder)
            raise ModelError(f"model endpoint {endpoint} had no request slot ({reason}) "
                             f"before the job's wall time limit, after waiting {waited:.1f} s")
        if caller.hold_s is not None and wait_s is not None and wait_s > caller.hold_s:
            caller.store.leave_model_line(endpoint, holder)  # a known wait: nobody else goes
            raise ModelBusy(endpoint, reason, wait_s)
        # after a pause, a little spread, so waiters told the same time do not all ask in the
        # same instant; a rate's next slot is waited for exactly (its waiter is first in line)
        spread = random.uniform(0, POLL_S / 2) if reason in SPREAD_AFTER else 0.0
        time.sleep(min(pause + spread, STALE_S / 2))
    system = body.get("system")  # Anthropic's, beside the messages
    messages = ([{"content": system if isinstance(system, str) else json.dumps(system)}]
                if system else []) + list(body.get("messages") or [])
    held = Held(caller, config, endpoint, holder, tokens, number=number, messages=messages)
    try:
        yield held
    finally:
        held.give_back()
