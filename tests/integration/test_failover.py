"""A Sentinel failover with a replica that lags: what the issue's reporter saw break (acknowledged
events vanishing or their seq reused, a job ending twice, an action run again with its attempt
count unchanged, jobs stuck until their lease ran out) must not happen with the settings as
shipped (each write of job state waits for the replica, `redis_replica_acks` 1).

The replica replicates through a proxy that holds the master's stream for `REPLICA_DELAY_S`
(tests/sentinel.py: `DelayingProxy`); what it holds when the master is SIGKILLed never reaches
the replica, so any write that did not wait for the replica is lost in the failover, as on a
real lagging link. The API and two workers (agent and tool pools) know Redis only by its
`redis+sentinel://` URL. Document and agent jobs run; SSE clients follow some of them across
the failover, resuming with `Last-Event-ID`, and record every event they were sent.

Checked once every job has ended:
- every job completed, each action has exactly one terminal event, and its result is the
  expected one;
- each job's final log has seq 1..N with no gap, and the API's SSE replay of it from scratch is
  the store's log;
- every event an SSE client received (before, during or after the failover) is byte-identical
  to the final log's event with that seq, and each client got seq 1, 2, 3, ... in order with
  no gap and no repeat across its reconnections;
- each action's `attempts` in the job record is at least its number of `action_started`
  events, and no two of them carry the same attempt (an action never runs again with its
  attempt count unchanged).

Recovery figures (time to promotion and to the last job's end, the reconciler's re-sends, the
writes that the replica did not acknowledge in time, the bytes the proxy dropped) are printed
for `-s`, never asserted: they depend on the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cortex_worker.protocol.events import ACTION_END_EVENTS, TERMINAL_EVENTS
from cortex_worker.store.connect import async_client, sync_client
from tests import harness
from tests.fake_llm import FakeLLM, Turn
from tests.integration.test_documents import action, submit
from tests.integration.test_sentinel import SentinelStack, job_status
from tests.sentinel import SentinelCluster

REPLICA_DELAY_S = 0.4
"""How far the replica lags: each write that waits for it takes at least this long."""
JOBS = 30
AGENT_EVERY = 5
"""One job in this many is an agent job (6 of 30), the rest document jobs."""
FOLLOW_EVERY = 4
"""One job in this many is followed by an SSE client from its submission on."""
ALL_ENDED_TIMEOUT_S = 480.0
"""Generous: a job stuck until its action's lease runs out (the issue: 5.7 minutes) fails."""

ENDED = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def stack(cortex_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[SentinelStack]:
    """The Sentinel stack of test_sentinel over a lagging replica. A long failover timeout
    keeps the sentinels from pointing the replica past the proxy (`SentinelCluster`)."""
    where = tmp_path_factory.mktemp("failover")
    with SentinelCluster(where, replica_delay_s=REPLICA_DELAY_S,
                         failover_timeout_ms=600_000) as cluster:
        env = {**cortex_env, "CORTEX_REDIS_URL": cluster.url}
        running = SentinelStack(cluster, env, where)
        try:
            yield running
        finally:
            running.close()


# -- jobs ---------------------------------------------------------------------------------
@dataclass
class Job:
    """A submitted job and the result each of its actions must end with."""

    id: str
    kind: str
    results: dict[str, Any]


def document_job(api: harness.Process, n: int) -> Job:
    """a (echo) and b (sleep) at once, c (echo of $a) after a: three actions, one dependency."""
    word = f"doc-{n}"
    doc = (action("a", "echo", {"message": word}) + action("b", "sleep", {"seconds": 0.3})
           + action("c", "echo", {"message": "$a"}, depends_on="a"))
    response = submit(api, doc)
    assert response.status_code == 202, response.text
    return Job(response.json()["id"], "document", {"a": word, "b": {"slept": 0.3}, "c": word})


def turn_number(body: dict[str, Any]) -> int:
    """The agent turn a chat request asks for: 1 + its assistant messages."""
    return 1 + sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")


def agent_job(api: harness.Process, llm: FakeLLM, n: int) -> Job:
    """A two-turn agent (tests/fake_llm.py): a thought and two actions, then the answer.
    Its model streams chunks, so its turns make many small writes (`emit_many` batches)."""
    model = f"failover-{n}-{os.urandom(3).hex()}"
    word = f"agent-{n}"
    first = ("<thought>Look it up. " + "Thinking it over. " * 10 + "</thought>"
             + action("a", "echo", {"message": word}) + action("b", "sleep", {"seconds": 0.3}))
    last = '<response final="true">Done: $a</response>'

    def answer(body: dict[str, Any]) -> Turn:
        number = turn_number(body)
        if number > 2:
            return Turn(fail_status=400, error_message=f"{model}: no turn {number}")
        return Turn(text=first if number == 1 else last, tokens_per_second=200)

    llm.script_default(model, answer)
    response = httpx.post(f"{api.url}/v1/jobs", json={"agent": "tester", "input": "Look.",
                                                      "options": {"model": model}}, timeout=30)
    assert response.status_code == 202, response.text
    return Job(response.json()["id"], "agent", {"a": word, "b": {"slept": 0.3}})


# -- SSE ----------------------------------------------------------------------------------
def sse_events(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(seq, the data's text exactly as sent) of each message of an SSE stream."""
    seq: int | None = None
    data: list[str] = []
    for line in lines:
        if line.startswith("id:"):
            seq = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line == "":
            if data and seq is not None:
                yield seq, "\n".join(data)
            seq, data = None, []


def read_log(api: harness.Process, job_id: str) -> list[tuple[int, str]]:
    """A new client's whole stream of an ended job."""
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events", timeout=60) as response:
        assert response.status_code == 200, response.read()
        return list(sse_events(response.iter_lines()))


@dataclass
class Follower:
    """An SSE client of one job, as a browser's EventSource is: on a broken or ended stream
    without the job's last event it connects again with `Last-Event-ID` = the last seq it
    got. Every event it is sent is kept, in order (`received`), with its text (`seen`)."""

    url: str
    job_id: str
    received: list[int] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)
    rewritten: list[tuple[int, str, str]] = field(default_factory=list)
    connections: int = 0
    breaks: list[str] = field(default_factory=list)
    ended: bool = False
    hung_up: bool = False

    def run(self, stop: threading.Event, cut: threading.Event) -> None:
        """Follow until the job's last event; once `cut` is set, hang up at the next event
        and resume (a client whose connection the failover broke: the API's own stream
        rides a failover out, so without this no client would resume across it)."""
        last = 0
        while not self.ended and not stop.is_set():
            headers = {"Last-Event-ID": str(last)} if last else {}
            self.connections += 1
            try:
                with httpx.stream("GET", f"{self.url}/v1/jobs/{self.job_id}/events",
                                  headers=headers, timeout=httpx.Timeout(30, read=90)) as response:
                    if response.status_code != 200:
                        self.breaks.append(f"{response.status_code}: {response.read()!r}")
                    else:
                        for seq, text in sse_events(response.iter_lines()):
                            self._got(seq, text)
                            last = max(last, seq)
                            if json.loads(text)["type"] in TERMINAL_EVENTS:
                                self.ended = True
                                break
                            if cut.is_set() and not self.hung_up:
                                self.hung_up = True
                                break
            except httpx.HTTPError as exc:
                self.breaks.append(repr(exc))
            if not self.ended:
                time.sleep(0.2)

    def _got(self, seq: int, text: str) -> None:
        self.received.append(seq)
        if seq in self.seen and self.seen[seq] != text:
            self.rewritten.append((seq, self.seen[seq], text))
        self.seen[seq] = text


# -- checks -------------------------------------------------------------------------------
def metric_total(api: harness.Process, name: str) -> float:
    """The sum over its labels of a counter on GET /metrics (0 if absent)."""
    text = httpx.get(f"{api.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((f"{name}{{", f"{name} ")))


def check_job(stack: SentinelStack, job: Job) -> list[dict[str, Any]]:
    """Every claim about one ended job; its final log."""
    api = stack.api
    events = stack.store.events_after(job.id)
    seqs = [int(e["seq"]) for e in events]
    assert seqs == list(range(1, len(events) + 1)), (job.id, seqs)
    replay = read_log(api, job.id)
    assert [s for s, _ in replay] == seqs, (job.id, [s for s, _ in replay], seqs)
    assert [json.loads(text) for _, text in replay] == events, job.id
    assert events[-1]["type"] == "job_completed", (job.id, [e["type"] for e in events])
    ends = Counter(e["data"]["action_id"] for e in events if e["type"] in ACTION_END_EVENTS)
    assert ends == dict.fromkeys(job.results, 1), (job.id, ends, events)

    record = httpx.get(f"{api.url}/v1/jobs/{job.id}", timeout=30).json()
    assert record["status"] == "completed", record
    views = {a["id"]: a for a in record["actions"]}
    started: dict[str, list[int]] = defaultdict(list)
    for event in events:
        if event["type"] == "action_started":
            started[event["data"]["action_id"]].append(int(event["data"]["attempt"]))
    for action_id, value in job.results.items():
        view = views[action_id]
        assert view["status"] == "ok" and view["result"] == value, (job.id, view)
        attempts = started[action_id]
        assert len(attempts) == len(set(attempts)), (job.id, action_id, attempts, events)
        assert view["attempts"] >= len(attempts), (job.id, view, attempts)
        assert view["attempts"] >= max(attempts, default=0), (job.id, view, attempts)
    return events


def test_the_master_killed_with_a_lagging_replica(stack: SentinelStack, fake_llm: FakeLLM
                                                  ) -> None:
    cluster, api = stack.cluster, stack.api
    assert cluster.proxy is not None
    jobs: list[Job] = []
    followers: list[Follower] = []
    stop, cut = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def follow(job: Job) -> None:
        follower = Follower(api.url, job.id)
        followers.append(follower)
        thread = threading.Thread(target=follower.run, args=(stop, cut), daemon=True)
        thread.start()
        threads.append(thread)

    submitted = time.monotonic()
    for n in range(JOBS):
        job = agent_job(api, fake_llm, n) if n % AGENT_EVERY == 1 else document_job(api, n)
        jobs.append(job)
        if n % FOLLOW_EVERY == 0 or job.kind == "agent":
            follow(job)
    submit_s = time.monotonic() - submitted
    try:
        # killed as soon as the last job is in: each POST waits for the replica, so the
        # first jobs have ended by then and the last are queued or running
        before = {j.id: job_status(api, j.id) for j in jobs[-10:]}
        killed, killed_at = time.monotonic(), time.time()
        old = cluster.kill_master()
        new = cluster.wait_failover(old)
        promoted = time.monotonic() - killed
        cut.set()
        deadline = killed + ALL_ENDED_TIMEOUT_S
        for job in jobs:
            harness.wait_until(lambda j=job: job_status(api, j.id) in ENDED,
                               timeout=max(1.0, deadline - time.monotonic()), interval=0.2,
                               message=lambda j=job: f"{j.id} did not end: "
                               f"{[e['type'] for e in stack.store.events_after(j.id)]}")
        last_end = time.monotonic() - killed
        for thread in threads:
            thread.join(timeout=120)
    finally:
        stop.set()

    logs = {job.id: check_job(stack, job) for job in jobs}
    for follower in followers:
        final = dict(read_log(api, follower.job_id))
        assert follower.ended, (follower.job_id, follower.received, follower.breaks)
        assert not follower.rewritten, (follower.job_id, follower.rewritten)
        assert follower.received == list(range(1, len(final) + 1)), (
            follower.job_id, follower.received, sorted(final))
        changed = {seq: (text, final.get(seq)) for seq, text in follower.seen.items()
                   if final.get(seq) != text}
        assert not changed, (follower.job_id, changed)

    redriven = Counter(e["data"]["kind"] for events in logs.values() for e in events
                       if e["type"] == "warning" and e["data"].get("kind", "").endswith("_redriven"))
    in_flight = Counter(before.values())
    print(f"\nfailover with the replica {REPLICA_DELAY_S * 1000:.0f} ms behind, "
          f"{JOBS} jobs, {JOBS // AGENT_EVERY} of them agents (submitted in {submit_s:.1f} s;"
          f" the last 10 just before the kill: {dict(in_flight)}): master {old} -> {new} promoted after "
          f"{promoted:.1f} s, last job ended {last_end:.1f} s after the kill; reconciler "
          f"re-sends: {dict(redriven)}; unreplicated writes: "
          f"{metric_total(api, 'cortex_unreplicated_writes_total'):.0f}; bytes the proxy "
          f"dropped at the kill: {cluster.proxy.dropped}; SSE clients: {len(followers)}, "
          f"connections {sum(f.connections for f in followers)}, resumed after the failover "
          f"{sum(f.hung_up for f in followers)}, breaks {sum(len(f.breaks) for f in followers)}")
    for job_id, events in sorted(logs.items(), key=lambda kv: -kv[1][-1]["ts"])[:3]:
        print(f"ended {events[-1]['ts'] - killed_at:.1f} s after the kill: {job_id}: "
              + ", ".join(f"{e['seq']}:{e['type']}({e['data'].get('action_id', '')}"
                          f"{e['data'].get('attempt', '')}{e['data'].get('kind', '')})"
                          f"@{e['ts'] - killed_at:+.1f}" for e in events))


# -- a command in flight at the kill --------------------------------------------------------
@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    with SentinelCluster(tmp_path) as running:
        yield running


def test_a_command_in_flight_at_the_kill_goes_to_the_promoted_replica(
        cluster: SentinelCluster) -> None:
    """What every write of job state is when the master dies under it (it waits for its
    replica): redis-py sent it again to the dead master's address until its retries ran out,
    and the action that made it stayed `running` until its lease ran out (5.7 minutes).
    The store's client (store/connect.py) asks the sentinels again on each reconnection."""
    client = sync_client(cluster.url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 40),
                         max_connections=4, pool_timeout=5)
    client.set("k", 1)
    outcome: list[Any] = []

    def write_and_wait() -> None:
        with client.pipeline(transaction=False) as pipe:
            pipe.set("k", 2)
            pipe.blpop(["nothing"], 3)  # in flight when the master dies
            try:
                outcome.extend(pipe.execute())
            except redis.RedisError as exc:
                outcome.append(exc)

    thread = threading.Thread(target=write_and_wait)
    thread.start()
    time.sleep(0.5)
    cluster.wait_failover(cluster.kill_master())
    thread.join()
    client.close()
    assert outcome == [True, None]


def test_an_async_command_in_flight_at_the_kill_goes_to_the_promoted_replica(
        cluster: SentinelCluster) -> None:
    """The same for the API's asyncio client (the SSE hub, readiness)."""
    async def scenario() -> list[Any]:
        client = async_client(cluster.url, retry=AsyncRetry(ExponentialBackoff(cap=1.0,
                                                                             base=0.05), 40))
        await client.set("k", 1)
        pending = asyncio.ensure_future(client.blpop(["nothing"], 3))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(lambda: cluster.wait_failover(cluster.kill_master()))
        try:
            return [await pending, await client.set("k", 2)]
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [None, True]
