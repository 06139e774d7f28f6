"""Fairness across tenants: a light tenant's latency while another tenant floods (issue 30).

Usage: python bench/fairness.py [--jobs 240] [--light 4] [--sleep 0.25] [--slots 2]
                                [--no-reference]

One stack: a private redis-server on 127.0.0.1 (free port), `cortex worker --pool agent`
(4 threads), `cortex worker --pool tool --concurrency 2` (prefork) and `cortex api` with API
keys for four tenants (`CORTEX_API_KEYS`). Every job is the same small document: one `sleep`
tool action of `--sleep` seconds and a response. All of it is stopped at the end, also on
errors and Ctrl-C.

1. One job's duration: 5 jobs of tenant acme, one at a time on the idle stack, each from just
   before its POST /v1/jobs to its last event (`ts` of job_completed, taken by the worker;
   this script and the workers share the machine's clock). The median is "one job".
2. The flood, fair (as shipped): tenant acme submits `--jobs` jobs (from 4 client threads),
   then tenant globex submits `--light` jobs, one after the other. Each tenant has a lane of
   its own in every pool's queue (cortex_worker/actions/fairness.py).
3. The reference, FIFO (skipped with `--no-reference`): the same with tenants acme-fifo and
   globex-fifo, whose lanes are set to the same one in Redis (`cortex:lanes`) before they
   submit anything: one queue shared in arrival order, as every pool was before e52cf42.

Printed for each run:

- globex's latency: each of its jobs from just before its POST to its last event (max, and
  all of them); the goal: max <= one job's duration + 1 s (PASS/MISS; the reference has none);
- acme's makespan, from just before its first POST to its last job's end, for context;
- acme's backlog when globex came: its jobs whose action had not started when globex's first
  job was queued (`job_queued`), and how many of those ended before globex's last job did;
- the reconciler's re-sends among acme's jobs (`warning` action_redriven): an action queued
  longer than `redrive_grace_s` (10 s) looks lost to it, and it sends it again (a duplicate
  the claim makes harmless, in the same lane); and the jobs whose action started twice.

This is a measurement, not a test: it exits 0 once the measurement has completed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.agent import loadavg  # noqa: E402
from bench.common import print_header, stop_on_sigterm  # noqa: E402
from tests import harness  # noqa: E402

MANIFESTS_DIR = REPO_ROOT / "tests" / "manifests"
TENANTS = ("acme", "globex", "acme-fifo", "globex-fifo")
AGENT_THREADS = 4
SUBMIT_THREADS = 4
LONE_JOBS = 5
GOAL_SLACK_S = 1.0
TERMINAL = {"job_completed", "job_failed", "job_cancelled"}
ENDED = {"completed", "failed", "cancelled"}
FIFO_LANE = 5  # the lane both reference tenants are put in (any but 0, acme's and globex's)


def document(seconds: float) -> str:
    body = json.dumps({"name": "sleep", "parameters": {"seconds": seconds}})
    return f'<action type="tool" mode="async" id="s">{body}</action><response>done</response>'


class Stack:
    """Redis, the workers, the API; keys for each tenant; a Store of the private Redis."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_dir = workdir / "logs"
        self.keys = {t: f"{t}-{secrets.token_urlsafe(24)}" for t in TENANTS}
        self.redis_server: harness.RedisServer | None = None
        self.store: Any = None
        self.api_url = ""
        self.clients: dict[str, httpx.Client] = {}

    def start(self, slots: int) -> None:
        self.redis_server = harness.RedisServer(log_dir=self.log_dir,
                                                data_dir=self.workdir / "redis")
        self.redis_server.start()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CORTEX_", "CELERY_")) and k != "REDIS_URL"}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent),
                                       env.get("PATH", os.defpath)])
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")]
                                            if p)
        env["PYTHONUNBUFFERED"] = "1"
        env["_TYPER_STANDARD_TRACEBACK"] = "1"
        env["CORTEX_REDIS_URL"] = self.redis_server.url
        env["CORTEX_MANIFESTS"] = str(MANIFESTS_DIR)
        env["CORTEX_WORKSPACE_ROOT"] = str(self.workdir / "workspaces")
        env["CORTEX_API_KEYS"] = ",".join(f"{t}:{k}" for t, k in self.keys.items())
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        # This process's own Cortex imports must see the private Redis, never a default one.
        for key in [k for k in os.environ if k.startswith("CORTEX_")]:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("CORTEX_")})
        from cortex_worker.store.state import Store

        self.store = Store.from_url(self.redis_server.url)
        harness.start_workers({"agent": AGENT_THREADS, "tool": slots}, env,
                              log_dir=self.log_dir, cwd=self.workdir, timeout=120)
        self.api_url = harness.start_api(env, log_dir=self.log_dir, cwd=self.workdir).url or ""

    def stop(self) -> None:
        try:
            for client in self.clients.values():
                client.close()
            harness.stop_all()
        finally:
            try:
                if self.store is not None:
                    self.store.redis.close()
            finally:
                if self.redis_server is not None:
                    self.redis_server.close()

    def submit(self, tenant: str, protocol: str, client: httpx.Client | None = None
               ) -> tuple[str, float]:
        """POST the document as `tenant`; (job id, time.time() just before the POST)."""
        client = client or self.clients.setdefault(tenant, httpx.Client(timeout=60))
        at = time.time()
        response = client.post(f"{self.api_url}/v1/jobs", json={"protocol": protocol},
                               headers={"Authorization": f"Bearer {self.keys[tenant]}"})
        if response.status_code != 202:
            raise RuntimeError(f"submit failed: {response.status_code} {response.text[:500]}")
        return response.json()["id"], at

    def submit_many(self, tenant: str, protocol: str, count: int, threads: int
                    ) -> list[tuple[str, float]]:
        def batch(n: int) -> list[tuple[str, float]]:
            with httpx.Client(timeout=60) as client:
                return [self.submit(tenant, protocol, client) for _ in range(n)]

        sizes = [count // threads + (i < count % threads) for i in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            return [job for jobs in pool.map(batch, sizes) for job in jobs]

    def wait_all(self, job_ids: list[str], timeout: float) -> dict[str, list[dict[str, Any]]]:
        """Each job's event log, once every one has ended."""
        pending = list(job_ids)
        deadline = time.monotonic() + timeout
        while pending:
            records = self.store.peek_many(pending, "status")
            pending = [j for j, r in zip(pending, records, strict=True)
                       if r is None or r.status not in ENDED]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} job(s) not ended after {timeout:.0f} s")
            time.sleep(0.05)
        logs = {j: self.store.events_after(j) for j in job_ids}
        for job_id, events in logs.items():
            if events[-1]["type"] != "job_completed":
                raise RuntimeError(f"job {job_id} ended {json.dumps(events[-1])[:500]}")
        return logs


def first(events: list[dict[str, Any]], kind: str) -> float:
    return next(e["ts"] for e in events if e["type"] == kind)


def one_job(stack: Stack, protocol: str) -> float:
    """The median of LONE_JOBS jobs' submit -> end, one at a time on the idle stack."""
    took = []
    for _ in range(LONE_JOBS):
        job_id, at = stack.submit("acme", protocol)
        took.append(stack.wait_all([job_id], 60)[job_id][-1]["ts"] - at)
    return statistics.median(took)


def flood(stack: Stack, heavy: str, light: str, protocol: str, jobs: int, light_jobs: int
          ) -> dict[str, Any]:
    """`heavy` submits `jobs` jobs, then `light` submits `light_jobs`: the figures."""
    started = time.monotonic()
    acme = stack.submit_many(heavy, protocol, jobs, SUBMIT_THREADS)
    globex = [stack.submit(light, protocol) for _ in range(light_jobs)]
    logs = stack.wait_all([j for j, _ in acme + globex], timeout=600)
    end = {j: events[-1]["ts"] for j, events in logs.items()}
    latency = [end[j] - at for j, at in globex]
    globex_queued = min(first(logs[j], "job_queued") for j, _ in globex)
    globex_done = max(end[j] for j, _ in globex)
    waiting = [j for j, _ in acme if first(logs[j], "action_started") > globex_queued]
    resent = [e["data"]["message"] for j, _ in acme for e in logs[j]
              if e["type"] == "warning" and e["data"].get("kind") == "action_redriven"]
    twice = sum(1 for events in logs.values()
                if sum(e["type"] == "action_started" for e in events) > 1)
    return {
        "latency": latency,
        "makespan": max(end[j] for j, _ in acme) - min(at for _, at in acme),
        "submit_s": max(at for _, at in acme) - min(at for _, at in acme),
        "waiting": len(waiting),
        "overtook": sum(1 for j in waiting if end[j] < globex_done),
        "before_first": sum(1 for j, _ in acme if end[j] < min(end[g] for g, _ in globex)),
        "resent": len(resent),
        "resent_example": resent[0] if resent else "",
        "twice": twice,
        "wall": time.monotonic() - started,
    }


def report(name: str, res: dict[str, Any], job_s: float, jobs: int, goal: bool) -> None:
    lat = res["latency"]
    print(f"{name}:")
    print(f"  globex latency (submit -> end): max {max(lat):.2f} s, each "
          f"{', '.join(f'{x:.2f}' for x in lat)} s")
    if goal:
        bound = job_s + GOAL_SLACK_S
        verdict = "PASS" if max(lat) <= bound else "MISS"
        print(f"  goal: max <= one job ({job_s:.2f} s) + {GOAL_SLACK_S:g} s = {bound:.2f} s: "
              f"{verdict}")
    print(f"  acme makespan: {res['makespan']:.2f} s for {jobs} jobs (submitted over "
          f"{res['submit_s']:.2f} s)")
    print(f"  acme jobs not started when globex came: {res['waiting']}; of those, ended before "
          f"globex's last: {res['overtook']}; acme jobs ended before globex's first: "
          f"{res['before_first']}")
    print(f"  reconciler re-sends among acme's actions (queued > redrive_grace_s): "
          f"{res['resent']}; actions that ran twice: {res['twice']}")
    if res["resent_example"]:
        print(f"    e.g. {res['resent_example']!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=240, help="acme's jobs (the flood)")
    parser.add_argument("--light", type=int, default=4, help="globex's jobs")
    parser.add_argument("--sleep", type=float, default=0.25, help="each job's sleep action (s)")
    parser.add_argument("--slots", type=int, default=2, help="the tool worker's concurrency")
    parser.add_argument("--no-reference", action="store_true", help="skip the FIFO reference")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    print_header(f"load average {loadavg()}")
    print(f"pools:    tool x{args.slots} (prefork), agent x{AGENT_THREADS} (threads)")
    print(f"jobs:     one `sleep` {args.sleep:g} s action each; acme {args.jobs} "
          f"(from {SUBMIT_THREADS} threads), then globex {args.light}")
    t0 = time.monotonic()
    protocol = document(args.sleep)
    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-fairness-"))
    stack = Stack(workdir)
    try:
        print("  starting redis, workers, api ...", flush=True)
        stack.start(args.slots)
        print(f"  logs in {stack.log_dir}", flush=True)
        job_s = one_job(stack, protocol)
        print(f"  one job alone: {job_s:.3f} s (median of {LONE_JOBS})", flush=True)
        fair = flood(stack, "acme", "globex", protocol, args.jobs, args.light)
        print(f"  fair run done in {fair['wall']:.1f} s", flush=True)
        fifo = None
        if not args.no_reference:
            from cortex_worker.store.keys import TENANT_LANES

            stack.store.redis.hset(TENANT_LANES, mapping={"acme-fifo": FIFO_LANE,
                                                          "globex-fifo": FIFO_LANE})
            fifo = flood(stack, "acme-fifo", "globex-fifo", protocol, args.jobs, args.light)
            print(f"  reference run done in {fifo['wall']:.1f} s", flush=True)
    finally:
        print("  stopping everything ...", flush=True)
        stack.stop()
    print(f"total wall time: {time.monotonic() - t0:.1f} s; load average at the end: "
          f"{loadavg()}")
    print()
    print(f"one job's duration (alone, submit -> end): {job_s:.2f} s")
    report("fair (a lane per tenant, as shipped)", fair, job_s, args.jobs, goal=True)
    if fifo is not None:
        report("reference (both tenants in one lane: FIFO, as before e52cf42)", fifo, job_s,
               args.jobs, goal=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
