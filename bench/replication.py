"""The cost of waiting for the replica: Store writes with `replica_acks=1` against `0`.

Usage: python bench/replication.py [--quick] [--jobs N] [--actions N] [--threads N,N]
                                   [--lag-ms MS]

Every write of job state (each Lua script of `Store._run`, each `emit_many` batch, a job's
creation) is followed, in the same round trip, by `WAIT 1 <redis_replica_wait_ms>` when the
master has a replica (cortex_worker/store/replication.py): the write returns once the replica
has it, so a failover cannot take it back. This measures what that costs, on one machine:

- a lone redis-server (no replica: nothing waits; the settings as shipped);
- a master and one replica (`--replicaof`), `replica_acks=0` (writes do not wait);
- the same master and replica, `replica_acks=1` (the default: each write waits).

All on 127.0.0.1 free ports, memory only, started here (tests/harness.py `RedisServer`) and
stopped at the end. With `--lag-ms` the replica replicates through tests/sentinel.py's
`DelayingProxy`, which holds the master's stream that long (a replica across a slow link).

The workload, per job: `create_job`, `begin`, `register` of N independent actions, then per
action `claim`, `finish` and one `emit`: 3 + 3N writes, each timed from this process. It runs
on 1 thread (each write's latency alone) and on several threads at once (throughput: each
thread has its own connection, so their WAITs overlap). The three setups alternate in rounds,
so a slow spell of this machine falls on all three. Printed: writes per second, per-write
latency p50 and p99, and each setup's ratio to the lone Redis.

This is a measurement, not a test: it always exits 0 once the measurement has completed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


from bench.common import pct, print_header, stop_on_sigterm  # noqa: E402
from cortex_worker.store.state import Store  # noqa: E402
from tests import harness  # noqa: E402
from tests.sentinel import DelayingProxy, in_sync  # noqa: E402

SETUPS = ("lone Redis", "replica, acks=0", "replica, acks=1")


@dataclass
class Sample:
    """One setup's writes in one run: each write's latency, and the run's span."""

    latencies: list[float] = field(default_factory=list)
    writes: int = 0
    span: float = 0.0


def timed(out: list[float], call: Callable[[], object]) -> None:
    started = time.perf_counter()
    call()
    out.append(time.perf_counter() - started)


def one_job(store: Store, actions: int, out: list[float]) -> int:
    """One job's writes, each timed into `out`; how many."""
    job_id = f"bench-{uuid.uuid4().hex[:12]}"
    ids = [f"a{i}" for i in range(actions)]
    timed(out, lambda: store.create_job(job_id, {"kind": "document"}, ttl=600,
                                        events=[("job_queued", {})]))
    timed(out, lambda: store.begin(job_id, [("job_started", {})]))
    specs = [{"id": a, "spec": json.dumps({"id": a, "type": "tool", "name": "echo"}),
              "deps": [], "after": [], "on_error": "fail"} for a in ids]
    timed(out, lambda: store.register(job_id, specs, close=True))
    for a in ids:
        timed(out, lambda a=a: store.claim(job_id, a, "bench:1", 60.0))
        timed(out, lambda a=a: store.emit(job_id, [("text", {"action_id": a, "text": "x"})]))
        timed(out, lambda a=a: store.finish(
            job_id, a, "ok", {"status": "ok", "value": 1}, 1, None,
            ("action_completed", {"action_id": a, "result": 1}), attempt=1, holder="bench:1"))
    return 3 + 3 * actions


def run(stores: Sequence[Store], jobs: int, actions: int) -> Sample:
    """`jobs` jobs split over one thread per store (each store its own connection)."""
    sample = Sample()
    per_thread: dict[int, list[float]] = defaultdict(list)
    counts = [0] * len(stores)

    def worker(n: int) -> None:
        for _ in range(jobs // len(stores)):
            counts[n] += one_job(stores[n], actions, per_thread[n])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(stores))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sample.span = time.perf_counter() - started
    sample.writes = sum(counts)
    sample.latencies = [x for n in sorted(per_thread) for x in per_thread[n]]
    return sample


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs and rounds")
    parser.add_argument("--jobs", type=int, default=60, help="jobs per run and setup")
    parser.add_argument("--actions", type=int, default=5, help="actions per job")
    parser.add_argument("--threads", default="1,8", help="thread counts to run with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lag-ms", type=float, default=0.0,
                        help="hold the master's stream to the replica this long")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.rounds = 16, 2
    threads = [int(n) for n in args.threads.split(",")]
    stop_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-replication-"))
    lone = harness.RedisServer(log_dir=workdir, data_dir=workdir / "lone")
    master = harness.RedisServer(log_dir=workdir, data_dir=workdir / "master")
    proxy: DelayingProxy | None = None
    replica: harness.RedisServer | None = None
    try:
        lone.start()
        master.start()
        upstream = master.port
        if args.lag_ms > 0:
            proxy = DelayingProxy(master.port, args.lag_ms / 1000).start()
            upstream = proxy.port
        replica = harness.RedisServer(log_dir=workdir, data_dir=workdir / "replica",
                                      extra_args=["--replicaof", harness.LOOPBACK, str(upstream)])
        replica.start()
        harness.wait_until(lambda: in_sync(replica.port), timeout=30)
        version = lone.client(decode_responses=True).info("server")["redis_version"]
        print_header(f"redis-server {version}, loopback")
        print(f"workload: {args.jobs} jobs x {args.actions} actions per run "
              f"({3 + 3 * args.actions} writes a job), {args.rounds} rounds, threads "
              f"{threads}, replica lag {args.lag_ms:g} ms")

        def stores(url: str, acks: int, n: int) -> list[Store]:
            return [Store.from_url(url, replica_acks=acks) for _ in range(n)]

        results: dict[tuple[str, int], list[Sample]] = defaultdict(list)
        for n in threads:
            made = {SETUPS[0]: stores(lone.url, 1, n), SETUPS[1]: stores(master.url, 0, n),
                    SETUPS[2]: stores(master.url, 1, n)}
            for store in made[SETUPS[2]]:
                assert store.replication.acks() == 1, "the replica is not connected"
            for store in made[SETUPS[0]]:
                assert store.replication.acks() == 0
            for setup_list in made.values():  # warm: scripts loaded, connections open
                run(setup_list, len(setup_list), 1)
            for number in range(args.rounds):
                order = SETUPS if number % 2 == 0 else tuple(reversed(SETUPS))
                for setup in order:
                    results[(setup, n)].append(run(made[setup], args.jobs, args.actions))
            for setup_list in made.values():
                for store in setup_list:
                    store.redis.close()

        for n in threads:
            print(f"\n{n} thread(s):")
            print(f"  {'setup':<18} {'writes/s':>10} {'p50':>11} {'p99':>11} "
                  f"{'writes/s ÷ lone':>16} {'p50 ÷ lone':>11}")
            figures: dict[str, tuple[float, float, float]] = {}
            for setup in SETUPS:
                samples = results[(setup, n)]
                writes = sum(s.writes for s in samples)
                rate = writes / sum(s.span for s in samples)
                latencies = [x for s in samples for x in s.latencies]
                figures[setup] = rate, pct(latencies, 50), pct(latencies, 99)
            base_rate, base_p50, _ = figures[SETUPS[0]]
            for setup, (rate, p50, p99) in figures.items():
                print(f"  {setup:<18} {rate:>10.0f} {ms(p50):>11} {ms(p99):>11} "
                      f"{rate / base_rate:>15.2f}x {p50 / base_p50:>10.2f}x")
            (rate0, p50_0, p99_0), (rate1, p50_1, p99_1) = figures[SETUPS[1]], figures[SETUPS[2]]
            print(f"  waiting for the replica (acks=1 ÷ acks=0): writes/s {rate1 / rate0:.2f}x, "
                  f"p50 {p50_1 / p50_0:.2f}x, p99 {p99_1 / p99_0:.2f}x")
        return 0
    finally:
        for server in (replica, master, lone):
            if server is not None:
                server.close()
        if proxy is not None:
            proxy.close()


if __name__ == "__main__":
    sys.exit(main())
