"""Dispatch cost: Cortex actions compared with plain Celery tasks, on the same Redis and pools.

Usage: python bench/dispatch.py [--quick]

One run starts a private redis-server on 127.0.0.1 (free port), real `cortex worker` processes
(tool pool, concurrency 4; agent pool, concurrency 2), `cortex api`, and a plain Celery worker
(`celery -A bench.rawapp worker -Q raw`, concurrency 4). The plain worker has Cortex's Celery
configuration: JSON, late acks, prefetch 1, task events, the same broker. All of them are
stopped at the end, also on errors and Ctrl-C.

Measured:

1. Latency, one task at a time (no queueing).
   - Raw Celery: `apply_async` to the start of the task body. The next task is sent only
     after the previous one has started.
   - Cortex: for each action of a chain of N echo actions (each depends on the one before),
     `ts(action_started) - ts(action_queued)`, from the job's event log. Both timestamps are
     taken by the workers: queued when the action became ready (in the finish script of its
     predecessor), started when a worker claims it. Run with `canvas: false` (readiness
     dispatch: the finishing worker sends the next task) and `canvas: true` (a Celery chain).
   - Rounds alternate: N raw tasks, one chain with readiness dispatch, one with canvas (and
     the other way round in every second round). Then a slow spell of this busy machine
     (everything runs on it) affects all three.
2. Throughput of no-op work.
   - Raw Celery: 2,000 tasks sent at once, from the first send to the last task end.
   - Cortex: one document of 2,000 independent async echo actions (`max_parallel` 10,000),
     from `job_started` to `job_completed`. Run with readiness dispatch and with canvas.
3. Makespan of the N-shaped DAG: A=0.05 s, B=0.3 s, C=0.3 s after A, D=0.05 s after A and B
   (sleep tool). Makespan is from the first action_started to the last action_completed,
   compared with the critical path (0.35 s). Several runs; the median is reported.

Also measured, to explain the figures: the round trip of each Store call a hop makes (spec
read, claim, finish) from this process; the phases of each chain hop from the event log; the
size of the first message of a canvas chain; and the CPU time each kind of process (the
worker's own process, its pool processes, redis-server) uses per hop (Linux /proc).

This is a measurement, not a test. It prints PASS/MISS for each target but always exits 0
once the measurement has completed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.common import pct, print_header, stop_on_sigterm  # noqa: E402
from tests import harness  # noqa: E402

MANIFESTS_DIR = REPO_ROOT / "tests" / "manifests"
TOOL_CONCURRENCY = 4
AGENT_CONCURRENCY = 2
TERMINAL = {"completed", "failed", "cancelled"}

TARGET_LATENCY_RATIO = 1.2  # Cortex dispatch p50 <= 1.2 x raw Celery p50
TARGET_THROUGHPUT_RATIO = 0.5  # Cortex no-op throughput >= 0.5 x raw Celery
TARGET_SLACK_MS = 50.0  # N-shape makespan <= critical path + 50 ms
CRITICAL_PATH_S = 0.35


# --------------------------------------------------------------------------- helpers


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def action(ident: str, name: str, params: dict[str, Any], mode: str = "async",
           **extra: Any) -> str:
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="tool" mode="{mode}" id="{ident}">{json.dumps(body)}</action>\n'


def chain_doc(n: int) -> str:
    parts = [action("c0", "echo", {"message": 0})]
    parts += [action(f"c{i}", "echo", {"message": i}, depends_on=[f"c{i - 1}"])
              for i in range(1, n)]
    return "".join(parts)


def wide_doc(n: int) -> str:
    return "".join(action(f"w{i}", "echo", {"message": i}) for i in range(n))


def n_shape_doc() -> str:
    return (action("A", "sleep", {"seconds": 0.05}) + action("B", "sleep", {"seconds": 0.3})
            + action("C", "sleep", {"seconds": 0.3}, depends_on=["A"])
            + action("D", "sleep", {"seconds": 0.05}, depends_on=["A", "B"]))


class Bench:
    """The running system: Redis, workers, API, and clients of them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.redis_server: harness.RedisServer | None = None
        self.env: dict[str, str] = {}
        self.api_url = ""
        self.store: Any = None
        self.raw_app: Any = None
        self.redis: Any = None

    # -- start-up

    def start(self) -> None:
        log_dir = self.workdir / "logs"
        self.redis_server = harness.RedisServer(log_dir=log_dir, data_dir=self.workdir / "redis")
        self.redis_server.start()
        url = self.redis_server.url
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CORTEX_", "CELERY_")) and k != "REDIS_URL"}
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")]
                                            if p)
        env["PYTHONUNBUFFERED"] = "1"
        env["CORTEX_REDIS_URL"] = url
        env["CORTEX_MANIFESTS"] = str(MANIFESTS_DIR)
        env["CORTEX_WORKSPACE_ROOT"] = str(self.workdir / "workspaces")
        self.env = env
        # This process's own Cortex imports must see the private Redis, never a default one.
        for key in [k for k in os.environ if k.startswith("CORTEX_")]:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("CORTEX_")})

        from bench import rawapp
        from cortex_worker.settings import Settings
        from cortex_worker.store.state import Store

        self.raw_app = rawapp.make_app(Settings(redis_url=url, manifests=MANIFESTS_DIR))
        self.raw_app.conf.broker_url = url
        self.store = Store.from_url(url)
        self.redis = self.redis_server.client(decode_responses=True)

        workers = harness.start_workers({"tool": TOOL_CONCURRENCY, "agent": AGENT_CONCURRENCY},
                                        env, log_dir=log_dir, cwd=self.workdir, wait=False)
        raw = harness.Process(
            [str(Path(sys.executable).parent / "celery"), "-A", "bench.rawapp", "worker",
             "-Q", rawapp.RAW_QUEUE, "-n", "raw@%h", "--loglevel=INFO", "--without-gossip",
             "--without-mingle", f"--concurrency={TOOL_CONCURRENCY}"],
            name="worker-raw", env=env, cwd=self.workdir, log_dir=log_dir)
        harness.wait_workers_ready([*workers.values(), raw], env, timeout=90)
        api = harness.start_api(env, log_dir=log_dir, cwd=self.workdir)
        self.api_url = api.url

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.close()
        if self.raw_app is not None:
            self.raw_app.close()
        try:
            harness.stop_all()
        finally:
            if self.redis_server is not None:
                self.redis_server.close()

    # -- Cortex jobs

    def run_job(self, protocol: str, timeout: float = 120.0, **options: Any) -> list[dict[str, Any]]:
        """Submit over HTTP, wait for the job to end, return its event log (read from Redis)."""
        response = httpx.post(f"{self.api_url}/v1/jobs",
                              json={"protocol": protocol, "options": options}, timeout=60)
        if response.status_code != 202:
            raise RuntimeError(f"submit failed: {response.status_code} {response.text[:500]}")
        job_id = response.json()["id"]
        deadline = time.monotonic() + timeout
        while True:
            job = self.store.peek(job_id, "status")
            if job is not None and job.status in TERMINAL:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job and job.status} after {timeout}s")
            time.sleep(0.02)
        events = self.store.events_after(job_id)
        if events[-1]["type"] != "job_completed":
            raise RuntimeError(f"job {job_id} ended {events[-1]}")
        return events

    # -- raw Celery

    def raw_sequential(self, samples: int) -> list[tuple[float, float, float]]:
        from bench.rawapp import send_noop

        key = f"bench:raw:{uuid.uuid4().hex}"
        out = []
        with self.raw_app.producer_or_acquire() as producer:
            for _ in range(samples):
                send_noop(self.raw_app, key, producer)
                item = self.redis.blpop([key], timeout=30)
                if item is None:
                    raise TimeoutError("a raw task did not start within 30 s")
                out.append(tuple(json.loads(item[1])))
        self.redis.delete(key)
        return out

    def raw_burst(self, count: int) -> list[tuple[float, float, float]]:
        from bench.rawapp import send_noop

        key = f"bench:raw:{uuid.uuid4().hex}"
        with self.raw_app.producer_or_acquire() as producer:
            for _ in range(count):
                send_noop(self.raw_app, key, producer)
        harness.wait_until(lambda: self.redis.llen(key) >= count, timeout=300, interval=0.02)
        out = [tuple(json.loads(x)) for x in self.redis.lrange(key, 0, -1)]
        self.redis.delete(key)
        return out

    # -- store scripts timed from here

    def script_round_trips(self, n: int) -> dict[str, list[float]]:
        """Time `claim` and `finish` (Lua, one round trip each) on a synthetic job."""
        from cortex_worker.store.state import dumps

        job_id = f"bench-{uuid.uuid4().hex}"
        self.store.create_job(job_id, {"kind": "bench", "limit": "100000"}, 600)
        self.store.set_job(job_id, status="running")
        entries = [{"id": f"s{i}", "spec": dumps({"id": f"s{i}", "type": "tool", "name": "echo"}),
                    "deps": [f"s{i - 1}"] if i else [], "after": [], "on_error": "stop"}
                   for i in range(n)]
        self.store.register(job_id, entries, close=True)
        timings: dict[str, list[float]] = {"claim": [], "finish": [], "ping": [], "spec": []}
        for i in range(n):
            t0 = time.perf_counter()
            self.redis.ping()
            t1 = time.perf_counter()
            self.store.spec(job_id, f"s{i}")  # what a canvas step reads before its claim
            t2 = time.perf_counter()
            self.store.claim(job_id, f"s{i}", "bench:1", 60.0, ())
            t3 = time.perf_counter()
            self.store.finish(job_id, f"s{i}", "ok", {"status": "ok"}, i, None,
                              ("action_completed", {"action_id": f"s{i}", "result": i}))
            t4 = time.perf_counter()
            timings["ping"].append(t1 - t0)
            timings["spec"].append(t2 - t1)
            timings["claim"].append(t3 - t2)
            timings["finish"].append(t4 - t3)
        return timings

    # -- what the canvas of a chain sends

    def chain_message_bytes(self, n: int) -> tuple[int, int]:
        """Body size of the first message of the canvas of a chain of `n` echo actions, as
        Cortex sends it (later steps in compact form) and as a plain Celery chain of the
        same signatures would be. Nothing is sent: the Celery app's publish is captured."""
        from unittest import mock

        from celery import chain
        from kombu.utils.json import dumps as kombu_dumps

        from cortex_worker.actions import dispatch
        from cortex_worker.app import app
        from cortex_worker.plan.canvas import decompose
        from cortex_worker.protocol.document import load_document

        plan = load_document(chain_doc(n)).plan
        step = decompose(plan)
        specs = {a: {"id": a, "type": "tool", "name": "echo"} for a in plan.nodes}
        job_id = uuid.uuid4().hex
        bodies: list[int] = []

        def capture(producer: Any, name: str, message: Any, **options: Any) -> None:
            bodies.append(len(kombu_dumps(message.body)))

        def plain(canvas: Any) -> None:  # the same signatures, through Celery's own chain
            chain(*canvas.tasks).apply_async()

        with mock.patch.object(app.amqp, "send_task_message", capture), \
                mock.patch.object(app.backend, "on_task_call", lambda *a: None):
            with dispatch.use_broker(dispatch.CeleryBroker(app)):
                dispatch.send_canvas(job_id, step, specs)
            broker = dispatch.CeleryBroker(app)
            broker.apply_canvas = plain  # type: ignore[method-assign]
            with dispatch.use_broker(broker):
                dispatch.send_canvas(job_id, step, specs)
        return bodies[0], bodies[1]


# --------------------------------------------------------------------------- event analysis


def by_action(events: list[dict[str, Any]], kind: str) -> dict[str, float]:
    return {e["data"]["action_id"]: e["ts"] for e in events if e["type"] == kind}


def dispatch_latencies(events: list[dict[str, Any]]) -> list[float]:
    queued, started = by_action(events, "action_queued"), by_action(events, "action_started")
    return [started[a] - queued[a] for a in started]


def hop_phases(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per action of a chain: claim→finish inside the worker, and the gap to the next claim."""
    started = by_action(events, "action_started")
    completed = by_action(events, "action_completed")
    queued = by_action(events, "action_queued")
    half = len(started) // 2
    return {"in_worker": [completed[a] - started[a] for a in started],
            "dispatch": [started[a] - queued[a] for a in started if a != "c0"],
            "first_half": [started[a] - queued[a] for a in started
                           if a != "c0" and int(a[1:]) < half],
            "second_half": [started[a] - queued[a] for a in started if int(a[1:]) >= half]}


def job_span(events: list[dict[str, Any]]) -> float:
    ts = {e["type"]: e["ts"] for e in events}
    return ts["job_completed"] - ts["job_started"]


def makespan(events: list[dict[str, Any]]) -> float:
    starts = [e["ts"] for e in events if e["type"] == "action_started"]
    ends = [e["ts"] for e in events if e["type"] == "action_completed"]
    return max(ends) - min(starts)


# --------------------------------------------------------------------------- the run


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (0, 0 elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


CPU_BUSY: dict[str, float] = {}


def timed(label: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`, print its wall time and record how busy the machine's CPUs were meanwhile."""
    t0 = time.monotonic()
    busy0, total0 = cpu_ticks()
    print(f"  {label} ...", end="", flush=True)
    result = fn()
    busy1, total1 = cpu_ticks()
    if total1 > total0:
        CPU_BUSY[label] = (busy1 - busy0) / (total1 - total0)
    print(f" {time.monotonic() - t0:.1f} s", flush=True)
    return result


def _ppid_and_cpu(pid: int) -> tuple[int, float]:
    """The parent and the CPU time (s, every thread: /proc/PID/task/*/schedstat) of `pid`."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    cpu = sum(int((task / "schedstat").read_text().split()[0])
              for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    return ppid, cpu


def _group(pid: int, parent: int) -> str:
    """Which of the benchmark's processes `pid` is: the tool pool's worker process or one of
    its pool processes, the raw worker's, redis-server, or other (agent pool, API)."""
    def cmd(p: int) -> str:
        try:
            return Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
        except OSError:
            return ""

    mine, parents = cmd(pid), cmd(parent)
    if "redis-server" in mine:
        return "redis"
    for marker, name in (("--pool tool", "tool"), ("bench.rawapp", "raw")):
        if marker in mine:
            return f"{name} pool" if marker in parents else f"{name} worker"
    return "other"


class ProcessCPU:
    """CPU time used by this benchmark's processes (every descendant of this process), by
    group. Linux only: elsewhere every reading is empty."""

    def __init__(self) -> None:
        self.groups: dict[int, str] = {}

    def read(self) -> dict[str, float]:
        procs: dict[int, tuple[int, float]] = {}
        for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
            if entry.name.isdigit():
                try:
                    procs[int(entry.name)] = _ppid_and_cpu(int(entry.name))
                except (OSError, ValueError, IndexError):
                    continue
        mine, todo = set(), [os.getpid()]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        while todo:
            for child in children.get(todo.pop(), []):
                mine.add(child)
                todo.append(child)
        out: dict[str, float] = {}
        for pid in mine:
            if pid not in self.groups:
                self.groups[pid] = _group(pid, procs[pid][0])
            out[self.groups[pid]] = out.get(self.groups[pid], 0.0) + procs[pid][1]
        return out

    def per_hop(self, before: dict[str, float], after: dict[str, float],
                hops: int) -> dict[str, float]:
        return {g: (after[g] - before.get(g, 0.0)) / hops for g in after}


def max_gap(times: Sequence[float]) -> float:
    """The longest interval between consecutive times (sorted)."""
    ordered = sorted(times)
    return max((b - a for a, b in itertools.pairwise(ordered)), default=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args(argv)
    chain_len, rounds = (30, 2) if args.quick else (100, 4)
    burst = 300 if args.quick else 2000
    n_runs = 3 if args.quick else 7

    stop_on_sigterm()
    print_header()
    import celery
    import kombu
    import redis as redis_py

    print(f"celery:   {celery.__version__}, kombu {kombu.__version__}, redis-py "
          f"{redis_py.__version__}")
    print(f"pools:    tool x{TOOL_CONCURRENCY}, agent x{AGENT_CONCURRENCY}, "
          f"raw celery x{TOOL_CONCURRENCY} (prefork, same broker and Celery settings)")
    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-dispatch-"))
    bench = Bench(workdir)
    t_start = time.monotonic()
    try:
        timed("starting redis, workers, api", bench.start)
        redis_version = bench.redis.info("server")["redis_version"]
        print(f"redis:    {redis_version}, logs in {workdir / 'logs'}")

        # Warm-up: every pool process imports, connects and loads the registry once.
        def warm() -> None:
            bench.raw_burst(40)
            bench.raw_sequential(10)
            bench.run_job("".join(action(f"s{i}", "sleep", {"seconds": 0.05})
                                  for i in range(12)))
            bench.run_job(chain_doc(10), canvas=False)
            bench.run_job(chain_doc(10), canvas=True)

        timed("warm-up", warm)

        # Latency: rounds alternate raw and Cortex, so a slow spell of the machine hits both.
        raw_seq: list[tuple[float, float, float]] = []
        cortex_lat: dict[bool, list[float]] = {False: [], True: []}
        phases: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
        spans: dict[bool, list[float]] = {False: [], True: []}
        # The order alternates too: raw, readiness, canvas; then canvas, readiness, raw.
        cpu = ProcessCPU()
        hop_cpu: dict[str, list[dict[str, float]]] = {"raw": [], "readiness": [], "canvas": []}
        round_p50: list[dict[bool | None, float]] = []  # each round's p50, by variant
        for r in range(rounds):
            order: list[bool | None] = [None, False, True]
            round_p50.append({})
            for variant in order if r % 2 == 0 else order[::-1]:
                before = cpu.read()
                if variant is None:
                    raw = timed(f"round {r + 1}/{rounds}: raw celery, {chain_len} "
                                "sequential tasks", lambda: bench.raw_sequential(chain_len))
                    hop_cpu["raw"].append(cpu.per_hop(before, cpu.read(), chain_len))
                    raw_seq += raw
                    round_p50[-1][None] = pct([start - sent for sent, start, _ in raw], 50)
                    continue
                canvas = variant
                events = timed(f"round {r + 1}/{rounds}: cortex chain of {chain_len}, "
                               f"canvas={canvas}",
                               lambda c=canvas: bench.run_job(chain_doc(chain_len), canvas=c))
                hop_cpu["canvas" if canvas else "readiness"].append(
                    cpu.per_hop(before, cpu.read(), chain_len))
                cortex_lat[canvas] += dispatch_latencies(events)
                round_p50[-1][canvas] = pct(dispatch_latencies(events), 50)
                for name, values in hop_phases(events).items():
                    phases[canvas].setdefault(name, []).extend(values)
                spans[canvas].append(job_span(events))
        raw_lat = [start - sent for sent, start, _ in raw_seq]

        raw_b = timed(f"raw celery burst of {burst}", lambda: bench.raw_burst(burst))
        raw_tp_s = max(end for _, _, end in raw_b) - min(sent for sent, _, _ in raw_b)
        raw_tp = burst / raw_tp_s
        cortex_tp: dict[bool, float] = {}
        cortex_tp_s: dict[bool, float] = {}
        gaps = {"raw": max_gap([start for _, start, _ in raw_b])}
        for canvas in (False, True):
            events = timed(f"cortex {burst} independent echo actions, canvas={canvas}",
                           lambda c=canvas: bench.run_job(wide_doc(burst), timeout=300,
                                                          canvas=c, max_parallel=10_000))
            cortex_tp_s[canvas] = job_span(events)
            gaps[f"canvas={canvas}"] = max_gap(
                [e["ts"] for e in events if e["type"] == "action_started"])
            cortex_tp[canvas] = burst / cortex_tp_s[canvas]

        shapes = []
        for _ in range(n_runs):
            events = bench.run_job(n_shape_doc())
            shapes.append(makespan(events))
        print(f"  n-shape: {n_runs} runs done", flush=True)

        rtt = timed("store script round trips", lambda: bench.script_round_trips(200))
        message = bench.chain_message_bytes(chain_len)
    finally:
        timed("stopping everything", bench.stop)
    print(f"total wall time: {time.monotonic() - t_start:.1f} s\n")

    # -- report
    raw_p50, raw_p99 = pct(raw_lat, 50), pct(raw_lat, 99)
    rows = [("measure", "raw celery", "cortex readiness", "cortex canvas", "target",
             "readiness", "canvas")]
    lat = {c: (pct(v, 50), pct(v, 99), max(v)) for c, v in cortex_lat.items()}
    rows.append(("dispatch latency p50 (ms)", ms(raw_p50), ms(lat[False][0]), ms(lat[True][0]),
                 f"<= {TARGET_LATENCY_RATIO}x raw = {ms(raw_p50 * TARGET_LATENCY_RATIO)}",
                 verdict(lat[False][0] <= TARGET_LATENCY_RATIO * raw_p50),
                 verdict(lat[True][0] <= TARGET_LATENCY_RATIO * raw_p50)))
    rows.append(("dispatch latency p99 (ms)", ms(raw_p99), ms(lat[False][1]), ms(lat[True][1]),
                 "", "", ""))
    rows.append(("dispatch latency max (ms)", ms(max(raw_lat)), ms(lat[False][2]),
                 ms(lat[True][2]), "", "", ""))
    rows.append(("  ratio p50 to raw", "1.00", f"{lat[False][0] / raw_p50:.2f}",
                 f"{lat[True][0] / raw_p50:.2f}", "", "", ""))
    rows.append((f"no-op throughput, {burst} (1/s)", f"{raw_tp:.0f}", f"{cortex_tp[False]:.0f}",
                 f"{cortex_tp[True]:.0f}",
                 f">= {TARGET_THROUGHPUT_RATIO}x raw = {raw_tp * TARGET_THROUGHPUT_RATIO:.0f}",
                 verdict(cortex_tp[False] >= TARGET_THROUGHPUT_RATIO * raw_tp),
                 verdict(cortex_tp[True] >= TARGET_THROUGHPUT_RATIO * raw_tp)))
    rows.append(("  elapsed (s)", f"{raw_tp_s:.2f}", f"{cortex_tp_s[False]:.2f}",
                 f"{cortex_tp_s[True]:.2f}", "", "", ""))
    rows.append(("  ratio to raw", "1.00", f"{cortex_tp[False] / raw_tp:.2f}",
                 f"{cortex_tp[True] / raw_tp:.2f}", "", "", ""))
    med = statistics.median(shapes)
    slack_ms = (med - CRITICAL_PATH_S) * 1000
    rows.append((f"N-shape makespan, median of {n_runs} (ms)", "", f"{med * 1000:.1f}", "",
                 f"<= {CRITICAL_PATH_S * 1000:.0f} + {TARGET_SLACK_MS:.0f}",
                 verdict(slack_ms <= TARGET_SLACK_MS), "n/a"))
    rows.append(("  over critical path (ms)", "", f"{slack_ms:.1f}", "", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                          strict=True)]
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))

    print(f"\nlatency samples: raw {len(raw_lat)}, cortex {len(cortex_lat[False])} per variant "
          f"({rounds} rounds; a round is {chain_len} sequential raw tasks, then one chain of "
          f"{chain_len} echo actions per variant)")
    print("ratio p50 to raw in each round (raw and both chains ran within about a second): "
          + "; ".join(f"{name} " + " ".join(f"{r[c] / r[None]:.2f}" for r in round_p50)
                      for name, c in (("readiness", False), ("canvas", True))))
    print("N-shape makespans (ms): " + ", ".join(f"{s * 1000:.1f}" for s in shapes)
          + f"  (critical path {CRITICAL_PATH_S * 1000:.0f})")
    print("\nwhere the time goes (ms, p50 / p99):")
    for canvas in (False, True):
        name = "canvas" if canvas else "readiness"
        hop = phases[canvas]
        per_action = statistics.median(spans[canvas]) / chain_len
        print(f"  chain, {name:9}: claim->finish in worker {ms(pct(hop['in_worker'], 50))} / "
              f"{ms(pct(hop['in_worker'], 99))}; ready->claim {ms(pct(hop['dispatch'], 50))} / "
              f"{ms(pct(hop['dispatch'], 99))}; job span per action {ms(per_action)}")
        print(f"    ready->claim p50, first half of the chain {ms(pct(hop['first_half'], 50))}, "
              f"second half {ms(pct(hop['second_half'], 50))}")
    raw_body = [end - start for _, start, end in raw_seq]
    print(f"  raw celery task body (one RPUSH): {ms(pct(raw_body, 50))} / "
          f"{ms(pct(raw_body, 99))}")
    for name in ("ping", "spec", "claim", "finish"):
        print(f"  store {name:6} from this process: {ms(pct(rtt[name], 50))} / "
              f"{ms(pct(rtt[name], 99))}")
    print("  a canvas step reads its spec (`store spec` above) before its claim; a readiness "
          "task carries it")
    print(f"  first message of the canvas of a chain of {chain_len}: {message[0]:,} bytes, "
          f"later steps compact ({message[1]:,} as Celery writes them); every hop decodes the "
          "rest of the chain twice and encodes it once")
    groups = ["tool worker", "tool pool", "raw worker", "raw pool", "redis", "other"]
    if any(hop_cpu.values()) and any(hop_cpu["raw"]):
        print("  CPU per hop (ms, median of the rounds; every process of the benchmark):")
        print("    " + " ".join(f"{g:>11}" for g in ["", *groups, "total"]))
        for name, readings in hop_cpu.items():
            cells = [statistics.median(r.get(g, 0.0) for r in readings) for g in groups]
            total = statistics.median(sum(r.values()) for r in readings)
            print(f"    {name:>11} " + " ".join(f"{ms(c):>11}" for c in [*cells, total]))
        print("    (worker: the Celery worker's own process, which receives every message and "
              "hands it to a pool process; pool: the processes that run the tasks)")

    print("  longest pause between two task starts in the bursts: "
          + ", ".join(f"{k} {ms(v)}" for k, v in gaps.items()))
    print("  machine CPU busy (all cores) during: "
          + "; ".join(f"{k.split(': ')[-1]} {v:.0%}" for k, v in CPU_BUSY.items()
                      if "round 1/" in k or "burst" in k or "independent" in k))

    print("\ntargets:")
    print(f"  dispatch p50 <= {TARGET_LATENCY_RATIO}x raw celery: readiness "
          f"{verdict(lat[False][0] <= TARGET_LATENCY_RATIO * raw_p50)} "
          f"({lat[False][0] / raw_p50:.2f}x), canvas "
          f"{verdict(lat[True][0] <= TARGET_LATENCY_RATIO * raw_p50)} "
          f"({lat[True][0] / raw_p50:.2f}x)")
    print(f"  throughput >= {TARGET_THROUGHPUT_RATIO}x raw celery: readiness "
          f"{verdict(cortex_tp[False] >= TARGET_THROUGHPUT_RATIO * raw_tp)} "
          f"({cortex_tp[False] / raw_tp:.2f}x), canvas "
          f"{verdict(cortex_tp[True] >= TARGET_THROUGHPUT_RATIO * raw_tp)} "
          f"({cortex_tp[True] / raw_tp:.2f}x)")
    print(f"  N-shape makespan <= critical path + {TARGET_SLACK_MS:.0f} ms: "
          f"{verdict(slack_ms <= TARGET_SLACK_MS)} (+{slack_ms:.1f} ms)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped", file=sys.stderr)
        sys.exit(130)
