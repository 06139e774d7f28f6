"""Model limits shared by the cluster (issue 30), with real Redis, TWO real agent worker
processes, the API over HTTP (the project's client) and the session's fake model server limiting
rates per model as a provider does (`tests/fake_llm.py`: `RateLimit`, `limit`, `refused`,
`admitted`, `max_in_flight_seen`).

The stack is this module's own: a Redis of its own (so only its two agent workers take its
turns) and a manifests directory of its own, whose agents differ only in their inline `model:`
blocks: `paced` declares `limits: {max_concurrent: 2}`; `patient` declares no limits and
`max_retries: 0`. Every turn the fake writes (`script_default`) is a short thought and an async
internal action (`set_variable`, run by the turn's coordinator: its `action_started` names the
worker that ran the turn); the last turn also gives the final response. Jobs need no tool
worker. Each job's input names it, so a request the provider refused names its job and turn.

Assertions are on the jobs' events, the provider's bookkeeping and /metrics; none is on elapsed
time (deadlines are backstops).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cortex_api.client import Client
from cortex_api.models import JobOptions
from cortex_worker.protocol.events import Event
from tests import harness
from tests.fake_llm import FakeLLM, RateLimit, Turn
from tests.integration.test_agents import unique
from tests.integration.test_metrics import scrape, value

AGENT_THREADS = 4  # per worker: fewer than the jobs, so both workers take some
TURNS = 3
FAST = 400.0  # tokens per second (of 4 characters): a turn streams in ~0.1-0.2 s
JOB_TIMEOUT = 90.0  # a backstop

AGENTS = """\
agents:
  - name: paced
    description: test_model_limits - its model declares max_concurrent 2.
    model:
      provider: openai
      base_url: ${CORTEX_TEST_LLM_URL}
      model: paced
      api_key_env: null
      limits: {max_concurrent: 2}
    max_turns: 6
  - name: patient
    description: test_model_limits - no limits declared, and no retries.
    model:
      provider: openai
      base_url: ${CORTEX_TEST_LLM_URL}
      model: patient
      api_key_env: null
      max_retries: 0
    max_turns: 6
"""

_JOB = re.compile(r"^Job (\d+) of a run")


@dataclass(frozen=True)
class Stack:
    client: Client
    api: harness.Process
    workers: dict[int, str]  # pid -> node name


@pytest.fixture(scope="module")
def stack(cortex_env: dict[str, str], fake_llm: FakeLLM,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Redis, two `cortex worker --pool agent` processes and the API, on this module's agents
    and the session's fake model server."""
    root = tmp_path_factory.mktemp("model-limits")
    manifests = root / "manifests"
    manifests.mkdir()
    (manifests / "agents.yaml").write_text(AGENTS)
    with harness.RedisServer(log_dir=root, data_dir=root / "redis") as redis:
        env = {**cortex_env, "CORTEX_REDIS_URL": redis.url,
               "CORTEX_MANIFESTS": str(manifests),
               "CORTEX_WORKSPACE_ROOT": str(root / "workspaces")}
        workers = [harness.Process(
            [*harness.cortex_command(), "worker", "--pool", "agent", "--concurrency",
             str(AGENT_THREADS), "--hostname", f"agent{n}@%h"],
            name=f"worker-agent{n}", env=env, cwd=root, log_dir=root) for n in (1, 2)]
        try:
            harness.wait_workers_ready(workers, env, timeout=60)
            with harness.api_running(env, log_dir=root, cwd=root) as api, \
                    Client(api.url) as client:
                yield Stack(client, api, {w.pid: f"agent{n}" for n, w in enumerate(workers, 1)})
        finally:
            harness.stop_all(processes=workers)


def steps(turns: int = TURNS) -> Callable[[dict[str, Any]], Turn]:
    """The fake's answer to a request: turn k (1 + the assistant messages in it) sets a
    variable with an async internal action; the last turn gives the final response too."""
    def make(body: dict[str, Any]) -> Turn:
        k = 1 + sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        call = json.dumps({"name": "set_variable", "parameters": {"name": f"v{k}", "value": k}})
        text = (f"<thought>Step {k}: keep the value.</thought>\n"
                f'<action type="internal" mode="async" id="s{k}">{call}</action>\n')
        if k >= turns:
            text += '<response final="true">Done.</response>\n'
        return Turn(text=text, tokens_per_second=FAST)
    return make


def run_jobs(stack: Stack, agent: str, model: str, jobs: int) -> list[list[Event]]:
    """Submit `jobs` jobs of `agent` on the fake's `model` at once; each one's whole event
    log once all have ended (in submission order)."""
    ids = [stack.client.submit_agent(agent, f"Job {n} of a run: work through the steps.",
                                     options=JobOptions(model=model)).id
           for n in range(jobs)]
    return [list(stack.client.events(job_id, timeout=JOB_TIMEOUT)) for job_id in ids]


def job_of(request: dict[str, Any]) -> tuple[int, int]:
    """(job number, turn) of a request the fake received."""
    messages = request["messages"]
    first = next(m["content"] for m in messages if m["role"] == "user")
    match = _JOB.match(first)
    assert match, first
    return int(match.group(1)), 1 + sum(1 for m in messages if m["role"] == "assistant")


@dataclass
class TurnSeen:
    worker: str  # the node that ran the turn (its internal action's `action_started`)
    waits: list[dict[str, Any]]  # the turn's model_waiting data


def turns_of(events: list[Event], workers: dict[int, str]) -> dict[int, TurnSeen]:
    """Each turn of a job: which worker ran it, and its waits for the model."""
    seen: dict[int, TurnSeen] = {}
    turn = 0
    waits: list[dict[str, Any]] = []
    for event in events:
        if event.type == "turn_started":
            turn, waits = event.data["turn"], []
        elif event.type == "model_waiting":
            waits.append(event.data)
        elif event.type == "action_started" and event.data["action_id"] == f"s{turn}":
            pid = int(event.data["worker"].rpartition(":")[2])
            seen[turn] = TurnSeen(workers.get(pid, f"pid {pid}"), waits)
    return seen


def ended(logs: list[list[Event]]) -> list[tuple[str, Any]]:
    return [(log[-1].type, log[-1].data.get("error")) for log in logs]


# ------------------------------------------------------------------------------ the tests


def test_declared_limits_keep_requests_in_flight_within_max_concurrent(
        stack: Stack, fake_llm: FakeLLM) -> None:
    """12 jobs of an agent whose model declares max_concurrent 2, against a provider that
    refuses a third request in flight: it never sees more than 2, refuses nothing, and the
    jobs that had to wait say so."""
    model = unique("paced")
    fake_llm.limit(model, RateLimit(max_in_flight=2, retry_after_s=1))
    fake_llm.script_default(model, steps())
    jobs = 12
    logs = run_jobs(stack, "paced", model, jobs)

    assert ended(logs) == [("job_completed", None)] * jobs
    assert fake_llm.refused(model) == 0
    assert fake_llm.max_in_flight_seen(model) <= 2
    assert len(fake_llm.admitted(model)) == jobs * TURNS  # one request per turn
    waits = [e.data for log in logs for e in log if e.type == "model_waiting"]
    assert waits, "no job waited for a slot"
    assert len({w["endpoint"] for w in waits}) == 1
    reasons = {w["reason"] for w in waits}
    assert "max_concurrent" in reasons and reasons <= {"max_concurrent", "queue"}, reasons
    # two workers ran these turns, and held to one limit between them
    workers = {t.worker for log in logs for t in turns_of(log, stack.workers).values()}
    assert workers == set(stack.workers.values())


def test_a_429_pauses_both_workers_requests_and_waiting_is_no_retry(
        stack: Stack, fake_llm: FakeLLM) -> None:
    """No limits declared, max_retries 0, and a provider that admits 3 requests a second:
    every job completes (a 429 is waited out, not retried); each 429 pauses the endpoint in
    Redis, and turns on BOTH workers wait on that pause; /metrics counts the 429s."""
    model = unique("patient")
    # a provider that says nothing of its limits until it refuses (only a 429's retry-after):
    # the limiter learns them from the 429s alone
    fake_llm.limit(model, RateLimit(requests_per_window=3, window_s=1.0, retry_after_s=1,
                                    counts=False))
    fake_llm.script_default(model, steps())
    jobs = 8
    logs = run_jobs(stack, "patient", model, jobs)

    assert ended(logs) == [("job_completed", None)] * jobs  # none failed with a 429
    refused = fake_llm.refused(model)
    assert refused >= 1, "the provider never refused: nothing was shown"
    assert len(fake_llm.admitted(model)) == jobs * TURNS  # each turn got its answer once
    # fewer 429s than answers (before the shared limiter, every worker's requests came back
    # at once after a 429: bench/limits.py's old run had 4.8 of them per answer)
    assert refused < jobs * TURNS, refused

    seen = {(n, k): t for n, log in enumerate(logs)
            for k, t in turns_of(log, stack.workers).items()}
    assert len(seen) == jobs * TURNS
    names = set(stack.workers.values())
    assert {t.worker for t in seen.values()} == names  # both workers ran turns
    paused = {key for key, t in seen.items() if any(w["reason"] == "paused" for w in t.waits)}
    # turns on both workers waited on a pause ...
    assert {seen[key].worker for key in paused} == names
    # ... and every turn whose request was refused waited on the pause it started
    refusals = [job_of(r) for r, outcome in zip(fake_llm.requests(model),
                                                fake_llm.outcomes(model), strict=True)
                if outcome == "rate_limited"]
    assert set(refusals) <= paused
    by_worker = {name: sum(1 for key in refusals if seen[key].worker == name) for name in names}

    # One pause for the cluster: every 429, whichever worker got it, is counted in the
    # endpoint's one shared state, which /metrics reads (requests: every slot taken).
    endpoint = next(w["endpoint"] for t in seen.values() for w in t.waits)
    samples, _ = scrape(stack.api)
    assert value(samples, "cortex_model_rate_limited_total", endpoint=endpoint) == refused, \
        by_worker
    assert value(samples, "cortex_model_requests_total", endpoint=endpoint) == \
        len(fake_llm.requests(model))
    assert value(samples, "cortex_model_waits_total", endpoint=endpoint) >= len(paused)
    assert value(samples, "cortex_model_in_flight", endpoint=endpoint) == 0

