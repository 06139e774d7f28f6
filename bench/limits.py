"""Model limits shared by the cluster: a rate-limited provider and two agent workers (issue 30).

Usage: python bench/limits.py [--jobs 40] [--turns 4] [--no-old] [--old-commit REV]

One stack: a private redis-server on 127.0.0.1 (free port), TWO `cortex worker --pool agent`
processes (threads, concurrency 100 each; node names agent1@ and agent2@), `cortex api`, and
the tests' fake OpenAI-compatible server (`tests/fake_llm.py`) in this process, limited as
a provider limits an account: 5 requests per sliding second and 3 in flight per model
(`RateLimit(requests_per_window=5, window_s=1, max_in_flight=3, retry_after_s=1)`); beyond
that it answers 429 with `retry-after: 1` and OpenAI's `x-ratelimit-*` headers, which its
admitted answers carry too. No tool worker: each job is `--turns` model turns; turns
1..k-1 are a short thought and an async internal action (`set_variable`, run by the turn's
coordinator; async, so the turn reads its answer to the end and a sync action's early hang-up
plays no part), the last is the final response (the fake's `script_default` writes each turn
from the request: turn = 1 + the assistant messages in it). Every answer streams ~0.45 s
(~90 tokens at 200 tokens/s). The agents are written to a temporary manifests directory:
inline `model:` blocks, so no `kind: Model` is needed.

Runs (all jobs submitted at once, each run against a model name of its own, so each has its
own provider window and its own endpoint in Redis):

(a) declared: the agent's model has `limits: {requests_per_minute: 300, max_concurrent: 3}`
    (exactly the provider's limits);
(b) adaptive: no limits declared: a 429's retry-after / x-ratelimit-* pause every worker's
    requests to the endpoint, and the adaptive concurrency cap halves at each 429;
(c) reference, the old behaviour: the same stack and scenario as (b) running the code from
    before the limiter (`--old-commit`, default the parent of 349b7ef, exported with `git
    archive` into a temporary directory and put first on the processes' PYTHONPATH; the fake
    and this script stay as they are). Skipped with `--no-old` or when git cannot export it.

Printed for each run:

- makespan: from just before the first POST /v1/jobs to the last job's end (the `ts` of its
  job_completed / job_failed event; workers and this script share the machine's clock);
- ideal: the provider's own best time for the requests it admitted: the larger of the rate
  bound (admitted requests / 5 per s) and the in-flight bound (the sum of the admitted
  requests' durations at the provider, admission to last byte written, / 3 in flight);
- the ratio makespan / ideal (goal <= 1.1x), the share of requests the provider refused with
  429 (goal <= 1 % declared, <= 5 % adaptive), jobs completed / failed (all must complete),
  the provider's peak in flight, and the jobs' `model_waiting` events by reason.

Also printed, to explain them: the gaps between the provider's admissions (p50, p90, max; its
pace is one per 0.2 s) and the admitted requests' durations; when each 429 came and why (the
fake does not say: its window held 5 admissions, else too many were in flight); the
`model_waiting` events per job. Before (a), 4 two-turn jobs warm both workers up (imports,
connections, the registry) on a model name of their own.

PASS/MISS is printed against each goal; (c) has no goals. This is a measurement, not a test:
it exits 0 once the measurement has completed.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.agent import base_env, loadavg, machine_ticks  # noqa: E402
from bench.common import pct, print_header, stop_on_sigterm  # noqa: E402
from tests import harness  # noqa: E402
from tests.fake_llm import FakeLLM, RateLimit, Turn  # noqa: E402

RPS = 5  # the provider: requests per sliding second ...
IN_FLIGHT = 3  # ... and requests being answered at once
RETRY_AFTER_S = 1.0
AGENT_THREADS = 100  # per agent worker
TOKENS_PER_SECOND = 200.0  # the fake's pace (one token = one chunk of 4 characters)
LIMITER_COMMIT = "349b7ef"  # llm/limits: the shared limiter; (c) runs the code before it
TERMINAL = {"completed", "failed", "cancelled"}
GOAL_RATIO = 1.1
GOAL_REFUSED = {"declared": 0.01, "adaptive": 0.05}

AGENT = """\
  - name: {name}
    description: bench/limits.py, on the fake provider (CORTEX_TEST_LLM_URL).
    model:
      provider: openai
      base_url: ${{CORTEX_TEST_LLM_URL}}
      model: {name}
      api_key_env: null{limits}
    max_turns: {max_turns}
"""


def manifest(max_turns: int, declared: bool = True) -> str:
    """The agents: `declared` (its model has the provider's limits, unless `declared` is
    False: the old code knows no `limits`) and `adaptive`."""
    limits = (f"\n      limits: {{requests_per_minute: {RPS * 60}, max_concurrent: {IN_FLIGHT}}}")
    agents = [AGENT.format(name="adaptive", limits="", max_turns=max_turns)]
    if declared:
        agents.append(AGENT.format(name="declared", limits=limits, max_turns=max_turns))
    return "agents:\n" + "".join(agents)

# ~240 characters of thought: with the action or the response, ~60 tokens a turn.
THOUGHT = ("Step {k} of {n}. I note the value found so far before I go on; the next step "
           "reads it back and adds the following part of the answer. Nothing here needs a "
           "tool: a variable of the job holds what I have, and the last turn writes it out.")


def make_turn(turns: int) -> Callable[[dict[str, Any]], Turn]:
    """The fake's default answer: turn k < `turns` sets a variable (an async internal action:
    the next turn starts once this one has ended), the last one gives the final response."""
    def make(body: dict[str, Any]) -> Turn:
        k = 1 + sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        thought = f"<thought>{THOUGHT.format(k=k, n=turns)}</thought>\n"
        if k < turns:
            call = json.dumps({"name": "set_variable",
                               "parameters": {"name": f"step{k}", "value": k}})
            text = f'{thought}<action type="internal" mode="async" id="s{k}">{call}</action>\n'
        else:
            text = f'{thought}<response final="true">All {turns} steps done.</response>\n'
        return Turn(text=text, tokens_per_second=TOKENS_PER_SECOND)
    return make


# --------------------------------------------------------------------------- the stack


class Stack:
    """Redis, two agent workers and the API, on code from `code_root`, for the fake `llm`."""

    def __init__(self, workdir: Path, llm: FakeLLM, manifests: Path, code_root: Path) -> None:
        self.workdir, self.llm, self.manifests, self.code_root = workdir, llm, manifests, code_root
        self.log_dir = workdir / "logs"
        self.redis_server: harness.RedisServer | None = None
        self.store: Any = None
        self.api_url = ""
        self.workers: list[harness.Process] = []
        self.processes: list[harness.Process] = []

    def start(self) -> None:
        self.redis_server = harness.RedisServer(log_dir=self.log_dir,
                                                data_dir=self.workdir / "redis")
        self.redis_server.start()
        from cortex_worker.store.state import Store  # (the key layout is the old code's too)

        self.store = Store.from_url(self.redis_server.url)
        env = base_env(self.redis_server.url, self.workdir, self.llm.url)
        env["CORTEX_MANIFESTS"] = str(self.manifests)
        env["PYTHONPATH"] = os.pathsep.join([str(self.code_root), str(REPO_ROOT)])
        self.env = env
        for n in (1, 2):
            proc = harness.Process(
                [*harness.cortex_command(), "worker", "--pool", "agent", "--concurrency",
                 str(AGENT_THREADS), "--hostname", f"agent{n}@%h"],
                name=f"worker-agent{n}", env=env, cwd=self.workdir, log_dir=self.log_dir)
            proc.pool = "agent"
            self.workers.append(proc)
        self.processes += self.workers
        harness.wait_workers_ready(self.workers, env, timeout=90)
        api = harness.start_api(env, log_dir=self.log_dir, cwd=self.workdir)
        self.processes.append(api)
        self.api_url = api.url

    def stop(self) -> None:
        try:
            harness.stop_all(processes=self.processes)
        finally:
            if self.store is not None:
                self.store.redis.close()
            if self.redis_server is not None:
                self.redis_server.close()

    def job_status(self, job_ids: Sequence[str]) -> list[str | None]:
        return [job.status if job else None for job in self.store.peek_many(job_ids, "status")]

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self.store.events_after(job_id)


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    name: str
    model: str
    makespan: float = 0.0
    submit_s: float = 0.0
    admitted: int = 0
    refused: int = 0
    busy_s: float = 0.0  # the admitted requests' durations at the provider, summed
    peak: int = 0
    completed: int = 0
    failed: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    waits: collections.Counter[str] = field(default_factory=collections.Counter)
    waiting_jobs: int = 0
    waits_per_job: list[int] = field(default_factory=list)
    refused_for: collections.Counter[str] = field(default_factory=collections.Counter)
    refused_at: list[float] = field(default_factory=list)  # s after the first request
    gaps: list[float] = field(default_factory=list)  # between admissions, s
    durations: list[float] = field(default_factory=list)  # of admitted requests, s

    @property
    def requests(self) -> int:
        return self.admitted + self.refused

    @property
    def rate_bound(self) -> float:
        return self.admitted / RPS

    @property
    def flight_bound(self) -> float:
        return self.busy_s / IN_FLIGHT

    @property
    def ideal(self) -> float:
        return max(self.rate_bound, self.flight_bound)

    @property
    def ratio(self) -> float:
        return self.makespan / self.ideal if self.ideal else float("nan")

    @property
    def refused_share(self) -> float:
        return self.refused / self.requests if self.requests else 0.0


def run_jobs(stack: Stack, llm: FakeLLM, name: str, agent: str, jobs: int, turns: int,
             timeout: float) -> Run:
    model = f"{name}-{uuid.uuid4().hex[:8]}"
    llm.script_default(model, make_turn(turns))
    run = Run(name, model)
    body = {"agent": agent, "input": "Work through the steps.", "options": {"model": model}}
    ids: list[str] = []
    with httpx.Client(timeout=60) as client:
        began = time.time()
        for _ in range(jobs):
            response = client.post(f"{stack.api_url}/v1/jobs", json=body)
            if response.status_code != 202:
                raise RuntimeError(f"submit failed: {response.status_code} {response.text[:500]}")
            ids.append(response.json()["id"])
        run.submit_s = time.time() - began
    deadline = time.monotonic() + timeout
    while True:
        statuses = stack.job_status(ids)
        if all(s in TERMINAL for s in statuses):
            break
        if time.monotonic() > deadline:
            left = sum(s not in TERMINAL for s in statuses)
            raise TimeoutError(f"run {name}: {left} of {jobs} jobs not ended after {timeout:.0f} s")
        time.sleep(0.1)
    ends = []
    for job_id in ids:
        events = stack.events(job_id)
        last = events[-1]
        ends.append(last["ts"])
        if last["type"] == "job_completed":
            run.completed += 1
        else:
            run.failed += 1
            run.errors[str(last["data"].get("error", last["type"]))[:160]] += 1
        waits = [e["data"]["reason"] for e in events if e["type"] == "model_waiting"]
        run.waits.update(waits)
        run.waiting_jobs += bool(waits)
        run.waits_per_job.append(len(waits))
    run.makespan = max(ends) - began
    admitted = llm.admitted(model)
    run.admitted = len(admitted)
    run.refused = llm.refused(model)
    run.durations = [(end or at) - at for at, end in admitted]
    run.busy_s = sum(run.durations)
    run.gaps = [b[0] - a[0] for a, b in itertools.pairwise(admitted)]
    run.peak = llm.max_in_flight_seen(model)
    # Why each 429 (the fake does not say): the window held RPS admissions, else too many
    # were in flight.
    requests = llm.requests(model)
    first_at = min((r["received_at"] for r in requests), default=0.0)
    for request, outcome in zip(requests, llm.outcomes(model), strict=True):
        if outcome != "rate_limited":
            continue
        t = request["received_at"]
        in_window = sum(1 for at, _ in admitted if t - 1.0 < at <= t)
        run.refused_for["requests" if in_window >= RPS else "in flight"] += 1
        run.refused_at.append(t - first_at)
    llm.script_default(model, None)
    return run


def old_tree(rev: str) -> Path | None:
    """The repository at `rev`, exported into a temporary directory (None: git could not)."""
    target = Path(tempfile.mkdtemp(prefix="cortex-bench-limits-old-"))
    try:
        archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev],
                                 capture_output=True, check=True, timeout=60).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"  (c) skipped: cannot export {rev}: {exc}", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        return None
    return target


# --------------------------------------------------------------------------- main


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(runs: list[Run], jobs: int) -> None:
    print("\nrun           requests  admitted  429s  429 share  peak in flight  completed  failed"
          "  makespan  ideal (rate / in-flight bound)  ratio")
    for r in runs:
        print(f"{r.name:<13} {r.requests:>8}  {r.admitted:>8}  {r.refused:>4}  "
              f"{r.refused_share:>8.1%}  {r.peak:>14}  {r.completed:>9}  {r.failed:>6}  "
              f"{r.makespan:>7.2f}s  {r.ideal:>6.2f}s ({r.rate_bound:.2f} / {r.flight_bound:.2f})"
              f"  {r.ratio:>5.2f}x")
    print("\nat the provider: gaps between admissions and durations of admitted requests (s):")
    for r in runs:
        print(f"  {r.name:<9} gaps p50 {pct(r.gaps, 50):.3f} p90 {pct(r.gaps, 90):.3f} "
              f"max {max(r.gaps, default=float('nan')):.3f} (1/{RPS} s = {1 / RPS:.3f}); "
              f"durations p50 {pct(r.durations, 50):.3f}")
    print()
    for r in runs:
        if r.refused:
            why = ", ".join(f"{k} {v}" for k, v in sorted(r.refused_for.items()))
            print(f"{r.name}: 429s for {why}; at s after the first request: "
                  + " ".join(f"{t:.2f}" for t in r.refused_at[:30])
                  + (" ..." if len(r.refused_at) > 30 else ""))
    for r in runs:
        waits = ", ".join(f"{k} {v}" for k, v in sorted(r.waits.items())) or "none"
        print(f"{r.name}: model_waiting events: {waits} (in {r.waiting_jobs} of {jobs} jobs; "
              f"per job p50 {pct(r.waits_per_job, 50):.0f}, max {max(r.waits_per_job)})")
        for error, count in r.errors.most_common(3):
            print(f"  {count} job(s) failed: {error}")
    print()
    for r in runs:
        if r.name == "old":
            print(f"old:      reference, no goals: {r.refused_share:.1%} of requests refused, "
                  f"{r.failed} of {jobs} jobs failed (the ratio, {r.ratio:.2f}x, counts only "
                  "the requests made before they failed)")
            continue
        goal = GOAL_REFUSED[r.name]
        print(f"{r.name + ':':<9} makespan/ideal {r.ratio:.2f}x (goal <= {GOAL_RATIO}x) "
              f"{verdict(r.ratio <= GOAL_RATIO)}; 429 share {r.refused_share:.1%} "
              f"(goal <= {goal:.0%}) {verdict(r.refused_share <= goal)}; "
              f"{r.completed}/{jobs} completed {verdict(r.completed == jobs)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=40, help="agent jobs per run (default 40)")
    parser.add_argument("--turns", type=int, default=4, help="model turns per job (default 4)")
    parser.add_argument("--no-old", action="store_true", help="skip (c), the old behaviour")
    parser.add_argument("--old-commit", default=f"{LIMITER_COMMIT}^",
                        help=f"the code of (c) (default {LIMITER_COMMIT}^)")
    args = parser.parse_args(argv)

    stop_on_sigterm()
    print_header(f"load average {loadavg()}")
    print(f"provider: fake OpenAI-compatible server, {RPS} requests per sliding 1 s, "
          f"{IN_FLIGHT} in flight, 429 with retry-after {RETRY_AFTER_S:g} + x-ratelimit-*")
    print(f"scenario: {args.jobs} agent jobs x {args.turns} turns, 2 agent workers x "
          f"{AGENT_THREADS} threads; each answer streams ~0.45 s")
    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-limits-"))
    manifests = workdir / "manifests"
    manifests.mkdir()
    (manifests / "agents.yaml").write_text(manifest(args.turns + 2))
    timeout = 120 + args.jobs * args.turns / RPS * 3
    runs: list[Run] = []
    t0 = time.monotonic()
    limit = RateLimit(requests_per_window=RPS, window_s=1.0, max_in_flight=IN_FLIGHT,
                      retry_after_s=RETRY_AFTER_S)
    with FakeLLM(rate_limit=limit) as llm:
        stack = Stack(workdir / "new", llm, manifests, REPO_ROOT)
        try:
            print("  starting redis, two agent workers, api ...", flush=True)
            stack.start()
            print(f"  logs in {stack.log_dir}", flush=True)
            # warm-up: imports, connections, the registry, in both workers
            warm = run_jobs(stack, llm, "warm-up", "adaptive", 4, 2, timeout)
            print(f"  warm-up: {warm.completed} jobs completed", flush=True)
            busy0 = machine_ticks()
            for name in ("declared", "adaptive"):
                print(f"  run {name} ...", flush=True)
                runs.append(run_jobs(stack, llm, name, name, args.jobs, args.turns, timeout))
                print(f"    makespan {runs[-1].makespan:.2f} s, {runs[-1].refused} 429s",
                      flush=True)
            busy1 = machine_ticks()
            print(f"  machine CPU busy (all cores) during (a) and (b): "
                  f"{(busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]):.0%}", flush=True)
        finally:
            stack.stop()
        if not args.no_old:
            code = old_tree(args.old_commit)
            if code is not None:
                old = Stack(workdir / "old", llm, manifests, code)
                (manifests / "agents.yaml").write_text(manifest(args.turns + 2, declared=False))
                try:
                    print(f"  run old ({args.old_commit}, exported to {code}) ...", flush=True)
                    old.start()
                    runs.append(run_jobs(old, llm, "old", "adaptive", args.jobs, args.turns,
                                         timeout))
                finally:
                    old.stop()
                    shutil.rmtree(code, ignore_errors=True)
    print(f"total wall time: {time.monotonic() - t0:.1f} s; load average at the end: "
          f"{loadavg()}")
    report(runs, args.jobs)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped", file=sys.stderr)
        sys.exit(130)
