"""Soak: a steady stream of short jobs for a while, sampling the memory of every process.

Usage: python bench/soak.py [--minutes 10] [--clients 4] [--interval 10] [--warmup-s 60]
                            [--json PATH]

Starts a private redis-server on 127.0.0.1 (free port), `cortex worker --pool agent
--concurrency 8`, `cortex worker --pool tool --concurrency 4` and `cortex api`, all with the
tests' manifests. Then `--clients` client threads each loop until the time is up: submit a
short document (echo → calculator, a 50 ms sleep, a response using `$` variables; every 10th
job also runs the sandboxed `python` tool), follow its SSE stream to the end, and check it
completed. Every `--interval` seconds the RSS of each process group (the API, each worker
with its pool children, and redis-server) is read from /proc.

The growth check (also used by tests/load/test_soak.py): after the warm-up, the last sample of
each Cortex process group must be at most the first post-warm-up sample × 1.3 + 20 MB.
Redis is reported but not bounded (it keeps every job for its retention period).

Exit status: 0 if every job completed and the growth check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.common import pct  # noqa: E402
from tests import harness  # noqa: E402

MANIFESTS_DIR = REPO_ROOT / "tests" / "manifests"
TERMINAL = {"job_completed", "job_failed", "job_cancelled"}
GROWTH_FACTOR = 1.3
GROWTH_SLACK_MB = 20.0
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# --------------------------------------------------------------------------- the stack


def base_env(redis_url: str, workdir: Path, extra: Mapping[str, str] | None = None
             ) -> dict[str, str]:
    """Environment of Cortex processes: nothing inherited from CORTEX_/CELERY_, this repo on
    the path, the private Redis, the test manifests, a workspace root under `workdir`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CORTEX_", "CELERY_")) and k != "REDIS_URL"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")]
                                        if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["_TYPER_STANDARD_TRACEBACK"] = "1"
    env["CORTEX_REDIS_URL"] = redis_url
    env["CORTEX_MANIFESTS"] = str(MANIFESTS_DIR)
    env["CORTEX_WORKSPACE_ROOT"] = str(workdir / "workspaces")
    env["CORTEX_TEST_LLM_URL"] = "http://127.0.0.1:9/v1"  # no agent job runs here
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy"):
        env.pop(key, None)
    env.update(extra or {})
    return env


@dataclass
class Stack:
    """A private Redis, workers and the API; `stop()` stops exactly these processes."""

    workdir: Path
    redis_server: harness.RedisServer
    env: dict[str, str]
    workers: dict[str, harness.Process]
    api: harness.Process

    @property
    def url(self) -> str:
        assert self.api.url is not None
        return self.api.url

    def groups(self) -> dict[str, harness.Process]:
        """name -> process (its whole process group is measured)."""
        return {"api": self.api, **{f"worker-{p}": w for p, w in self.workers.items()}}

    def stop(self) -> None:
        try:
            harness.stop_all(processes=[self.api, *self.workers.values()])
        finally:
            self.redis_server.close()


def start_stack(workdir: Path, pools: Mapping[str, int] | None = None,
                extra_env: Mapping[str, str] | None = None) -> Stack:
    """Redis, one worker per pool (`{"agent": 8, "tool": 4}` by default) and the API."""
    pools = dict(pools or {"agent": 8, "tool": 4})
    log_dir = workdir / "logs"
    server = harness.RedisServer(log_dir=log_dir, data_dir=workdir / "redis")
    server.start()
    started: list[harness.Process] = []
    try:
        env = base_env(server.url, workdir, extra_env)
        workers = harness.start_workers(pools, env, log_dir=log_dir, cwd=workdir, timeout=90)
        started += workers.values()
        api = harness.start_api(env, log_dir=log_dir, cwd=workdir)
    except BaseException:
        with contextlib.suppress(Exception):
            harness.stop_all(processes=started)
        server.close()
        raise
    return Stack(workdir, server, env, workers, api)


# --------------------------------------------------------------------------- memory


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return 0
    return int(fields[1]) * PAGE


def group_rss(proc: harness.Process) -> int:
    """RSS summed over the process group of `proc` (a worker and its pool children)."""
    return sum(rss_bytes(pid) for pid in proc.members())


def redis_rss(server: harness.RedisServer) -> int:
    popen = getattr(server, "_proc", None) or getattr(server, "process", None)
    pid = getattr(popen, "pid", None)
    if pid is None:
        with contextlib.suppress(Exception):
            client = server.client()
            try:
                return int(client.info("memory")["used_memory_rss"])
            finally:
                client.close()
        return 0
    return rss_bytes(pid)


# --------------------------------------------------------------------------- the stream


def action(ident: str, name: str, params: dict[str, Any], **extra: Any) -> str:
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="tool" mode="async" id="{ident}">{json.dumps(body)}</action>\n'


def soak_document(n: int) -> str:
    doc = (action("a", "echo", {"message": n})
           + action("b", "calculator", {"expression": f"{n} * 2"}, depends_on=["a"],
                    output_key="twice")
           + action("c", "sleep", {"seconds": 0.05}))
    if n % 10 == 0:
        doc += action("p", "python", {"code": f"print({n} + 1)"})
    return doc + "<response>job $a doubled is $twice</response>"


def follow(client: httpx.Client, url: str, job_id: str, timeout: float = 120) -> list[dict]:
    """The job's SSE events until the stream ends."""
    events: list[dict[str, Any]] = []
    with client.stream("GET", f"{url}/v1/jobs/{job_id}/events", timeout=timeout) as response:
        response.raise_for_status()
        data: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                events.append(json.loads("\n".join(data)))
                data = []
    return events


@dataclass
class SoakResult:
    seconds: float
    jobs: int = 0
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # submit → terminal event, seconds
    samples: list[dict[str, float]] = field(default_factory=list)  # t and MB per group

    def growth(self, warmup_s: float) -> dict[str, dict[str, float | bool]]:
        """Per Cortex process group: first post-warm-up sample, last sample, bound, ok."""
        after = [s for s in self.samples if s["t"] >= warmup_s]
        if len(after) < 2:
            raise ValueError(f"fewer than 2 samples after the {warmup_s:g}s warm-up: "
                             f"{len(self.samples)} samples over {self.seconds:.0f}s")
        out: dict[str, dict[str, float | bool]] = {}
        for name in after[0]:
            if name in ("t", "redis"):
                continue
            first, last = after[0][name], after[-1][name]
            bound = first * GROWTH_FACTOR + GROWTH_SLACK_MB
            out[name] = {"first_mb": first, "last_mb": last, "peak_mb": max(s[name] for s in after),
                         "bound_mb": bound, "ok": last <= bound}
        return out


def run_soak(stack: Stack, seconds: float, *, clients: int = 4, interval: float = 10.0,
             on_sample: Callable[[dict[str, float]], None] | None = None) -> SoakResult:
    """Keep `clients` submit-and-follow loops busy for `seconds`, sampling RSS every
    `interval` s (one sample at t=0 and one at the end)."""
    result = SoakResult(seconds=seconds)
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + seconds
    stop = threading.Event()
    counter = iter(range(10**9))

    def sample() -> None:
        row = {"t": round(time.monotonic() - start, 1)}
        for name, proc in stack.groups().items():
            row[name] = round(group_rss(proc) / 2**20, 1)
        row["redis"] = round(redis_rss(stack.redis_server) / 2**20, 1)
        result.samples.append(row)
        if on_sample is not None:
            on_sample(row)

    def sampler() -> None:
        sample()
        while not stop.wait(interval):
            sample()

    def client_loop() -> None:
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < deadline:
                with lock:
                    n = next(counter)
                began = time.monotonic()
                try:
                    response = client.post(f"{stack.url}/v1/jobs",
                                           json={"protocol": soak_document(n)})
                    if response.status_code != 202:
                        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
                    job_id = response.json()["id"]
                    events = follow(client, stack.url, job_id)
                    last = events[-1]["type"] if events else "no events"
                    ok = last == "job_completed"
                    why = f"job {job_id} ended with {last}"
                except Exception as exc:
                    ok, why = False, f"job #{n}: {type(exc).__name__}: {exc}"
                with lock:
                    result.jobs += 1
                    if ok:
                        result.completed += 1
                        result.latencies.append(time.monotonic() - began)
                    elif len(result.failures) < 20:
                        result.failures.append(why)

    sampling = threading.Thread(target=sampler, name="soak-sampler", daemon=True)
    sampling.start()
    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}", daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    sampling.join()
    sample()
    result.seconds = time.monotonic() - start
    return result


def report(result: SoakResult, warmup_s: float) -> tuple[str, bool]:
    lines = [
        f"soak: {result.seconds:.0f} s, {result.jobs} jobs, {result.completed} completed "
        f"({result.completed / result.seconds:.1f} jobs/s); job latency p50 "
        f"{pct(result.latencies, 50) * 1000:.0f} ms, p99 {pct(result.latencies, 99) * 1000:.0f} ms",
    ]
    for failure in result.failures:
        lines.append(f"  FAILED: {failure}")
    names = [k for k in result.samples[0] if k != "t"]
    lines.append("RSS (MB) per sample: " + "  ".join(f"{n:>14}" for n in ["t", *names]))
    for row in result.samples:
        lines.append("                     " + "  ".join(f"{row[n]:>14}" for n in ["t", *names]))
    growth = result.growth(warmup_s)
    ok = result.completed == result.jobs and result.jobs > 0
    for name, g in growth.items():
        lines.append(f"{name}: first after warm-up {g['first_mb']:.1f} MB, last {g['last_mb']:.1f} "
                     f"MB, peak {g['peak_mb']:.1f} MB, bound {g['bound_mb']:.1f} MB: "
                     f"{'ok' if g['ok'] else 'GROWTH OVER BOUND'}")
        ok = ok and bool(g["ok"])
    return "\n".join(lines), ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--json", type=Path, help="also write the samples and figures here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="cortex-soak-"))
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')} "
          f"{platform.platform()}, {os.cpu_count()} CPUs; logs in {workdir / 'logs'}", flush=True)
    stack = start_stack(workdir)
    try:
        result = run_soak(stack, args.minutes * 60, clients=args.clients, interval=args.interval,
                          on_sample=lambda row: print(f"sample {row}", flush=True))
    finally:
        stack.stop()
    text, ok = report(result, args.warmup_s)
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "seconds": result.seconds, "jobs": result.jobs, "completed": result.completed,
            "failures": result.failures, "samples": result.samples,
            "latency_p50_s": pct(result.latencies, 50), "latency_p99_s": pct(result.latencies, 99),
            "growth": result.growth(args.warmup_s), "mean_latency_s":
                statistics.fmean(result.latencies) if result.latencies else None}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
