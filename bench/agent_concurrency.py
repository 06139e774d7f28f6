"""Agent pool concurrency: how many jobs waiting on model streams one agent worker carries.

Usage: python bench/agent_concurrency.py [--jobs 100] [--stream-s 5] [--tps 10]
                                         [--modes threads,prefork] [--prefork-concurrency 4]

One run starts a private redis-server on 127.0.0.1 (free port), `cortex api`, and the tests'
fake OpenAI-compatible model server (`tests/fake_llm.py`) in this process on 127.0.0.1. Then,
for each mode, ONE agent worker process:

- `threads`: `cortex worker --pool agent`, as shipped: Celery's threads pool, default
  concurrency 200;
- `prefork`: `celery -A cortex_worker.app worker -Q agent --pool prefork --concurrency 4`
  (`cortex worker` does not expose the pool type), a parent and 4 child processes;
- gevent/eventlet: measured only if installed in this interpreter (`--pool gevent
  --concurrency 100`).

Each mode gets a warm-up (one short job per slot, all at once), then `--jobs` agent jobs are
submitted at once over the API (16 client threads). Each job's single turn streams for
`--stream-s` seconds (`--tps` tokens per second; a token is one chunk of 4 characters) and ends
with a `final="true"` response, so each job holds one model stream open and runs no action.

Measured:

- peak concurrently open model streams at the fake server, from its own log: each request is
  the interval from its arrival to its last chunk; the peak is the maximum overlap. Also how
  long after the first submission the last request arrived, and the makespan of the batch;
- the worker's memory (RSS summed over its processes, and PSS, which counts shared pages
  once) from /proc, sampled every 0.2 s: after start-up, after warm-up, and the peak; its CPU
  time (utime + stime of all its processes) during the batch, and the busiest 1 s;
- CPU time of Redis and of this process (which runs the fake model server) during the batch;
- with `--token-cost`: the CPU one thread spends per streamed token on what an agent turn does
  with it (read it from the stream, feed the parser, log its chunks as the coordinator does:
  a `ChunkWriter`, at most every 50 ms), measured in this process against the same fake model
  and Redis.

All processes are stopped at the end, also on errors and Ctrl-C. This is a measurement, not a
test: it always exits 0 once the measurement has completed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.agent import CHUNK_CHARS, Stack, filler, loadavg, machine_ticks, pct, table  # noqa: E402
from bench.common import print_header, stop_on_sigterm  # noqa: E402
from tests import harness  # noqa: E402
from tests.fake_llm import Turn  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
SUBMIT_THREADS = 16


# --------------------------------------------------------------------------- /proc sampling


def proc_cpu_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def proc_pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler:
    """Samples a process group's memory and CPU every `interval` seconds in a thread."""

    def __init__(self, proc: harness.Process, others: dict[str, int], interval: float = 0.2):
        self.proc = proc
        self.others = others  # name -> pid, CPU only
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> dict[str, Any]:
        pids = self.proc.members()
        rss = pss = threads = 0
        cpu: dict[int, int] = {}
        for pid in pids:
            status = proc_status(pid)
            rss += status.get("VmRSS", 0)
            threads += status.get("Threads", 0)
            pss += proc_pss_kb(pid)
            ticks = proc_cpu_ticks(pid)
            if ticks is not None:
                cpu[pid] = ticks
        other = {name: proc_cpu_ticks(pid) or 0 for name, pid in self.others.items()}
        times = os.times()
        return {"t": time.monotonic(), "pids": len(pids), "rss_kb": rss, "pss_kb": pss,
                "threads": threads, "cpu": cpu, "other": other,
                "self_cpu": times.user + times.system, "machine": machine_ticks()}

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.samples.append(self.sample())
        return self.samples


def cpu_seconds(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Worker CPU between two samples (per pid, so children that appear or go are fine)."""
    total = 0
    for pid, ticks in b["cpu"].items():
        total += ticks - a["cpu"].get(pid, 0) if pid in a["cpu"] else 0
    return total / TICK


def busiest_second(samples: list[dict[str, Any]]) -> float:
    """The largest worker CPU use (in cores) over any ~1 s window of samples."""
    best = 0.0
    j = 0
    for i in range(len(samples)):
        while samples[i]["t"] - samples[j]["t"] > 1.0:
            j += 1
        k = j - 1 if j > 0 else 0
        span = samples[i]["t"] - samples[k]["t"]
        if span >= 0.9:
            best = max(best, cpu_seconds(samples[k], samples[i]) / span)
    return best


# --------------------------------------------------------------------------- the batch


def turn_text(tokens: int) -> str:
    """A turn of exactly `tokens` chunks: a thought, then a short final response."""
    response = '<response final="true">done</response>\n'
    shell = len("<thought>\n</thought>\n") + len(response)
    body = filler(max(8, tokens * CHUNK_CHARS - shell))
    text = f"<thought>{body}\n</thought>\n{response}"
    return text + " " * (-len(text) % CHUNK_CHARS)


def peak_overlap(intervals: list[tuple[float, float]]) -> tuple[int, float]:
    """Maximum number of overlapping intervals, and when it was first reached."""
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals],
                    key=lambda p: (p[0], p[1]))
    level = best = 0
    when = 0.0
    for t, delta in points:
        level += delta
        if level > best:
            best, when = level, t
    return best, when


def worker_args(mode: str, prefork_concurrency: int, gevent_concurrency: int,
                threads: int | None = None) -> list[str]:
    common = ["--loglevel=INFO", "--without-gossip", "--without-mingle"]
    celery = str(Path(sys.executable).parent / "celery")
    if mode == "threads":
        slots = [] if threads is None else ["--concurrency", str(threads)]
        return [*harness.cortex_command(), "worker", "--pool", "agent", *slots]
    if mode == "prefork":
        return [celery, "-A", "cortex_worker.app", "worker", "-Q", "agent", "-n",
                "agent-prefork@%h", "--pool", "prefork", f"--concurrency={prefork_concurrency}",
                *common]
    return [celery, "-A", "cortex_worker.app", "worker", "-Q", "agent", "-n",
            f"agent-{mode}@%h", "--pool", mode, f"--concurrency={gevent_concurrency}", *common]


def run_mode(stack: Stack, mode: str, args: argparse.Namespace,
             offset: float) -> dict[str, Any]:
    assert stack.llm is not None and stack.redis_server is not None
    assert stack.redis_server.process is not None
    proc = harness.Process(worker_args(mode, args.prefork_concurrency, args.jobs,
                                       args.threads_concurrency),
                           name=f"worker-agent-{mode}", env=stack.env, cwd=stack.workdir,
                           log_dir=stack.log_dir)
    try:
        harness.wait_workers_ready([proc], stack.env, timeout=90)
        time.sleep(1.0)
        sampler = Sampler(proc, {"redis": stack.redis_server.process.pid})
        ready = sampler.sample()
        slots = {"threads": args.threads_concurrency or 100,
                 "prefork": args.prefork_concurrency}.get(mode, args.jobs)

        # Warm-up: one short job per slot, at once, so that every pool process and thread has
        # loaded the registry, its clients and imports before the measured batch.
        warm_model = f"warm-{mode}-{uuid.uuid4().hex[:6]}"
        n_warm = min(args.jobs, slots)
        stack.llm.script(warm_model, [Turn(text=turn_text(10), tokens_per_second=50,
                                           chunk_chars=CHUNK_CHARS)] * n_warm)
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(SUBMIT_THREADS) as pool:
            warm_ids = list(pool.map(lambda _: stack.submit_agent(warm_model, client=client),
                                     range(n_warm)))
        for job_id in warm_ids:
            stack.wait_job(job_id, timeout=120)
        time.sleep(1.0)
        warm = sampler.sample()

        tokens = round(args.tps * args.stream_s)
        model = f"slow-{mode}-{uuid.uuid4().hex[:6]}"
        stack.llm.script(model, [Turn(text=turn_text(tokens), tokens_per_second=args.tps,
                                      chunk_chars=CHUNK_CHARS)] * args.jobs)
        sampler.start()
        t_submit = time.monotonic()
        submitted: dict[str, float] = {}  # job input -> when its POST was sent

        def submit(n: int) -> str:
            submitted[f"bench job {n}"] = time.monotonic()
            return stack.submit_agent(model, f"bench job {n}", client=client)

        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(SUBMIT_THREADS) as pool:
            job_ids = list(pool.map(submit, range(args.jobs)))
        t_submitted = time.monotonic()
        waves = -(-args.jobs // slots)
        deadline = time.monotonic() + waves * (args.stream_s + 2) * 1.5 + 60
        statuses: list[str] = []
        while time.monotonic() < deadline:
            pipe = stack.store.redis.pipeline()
            for job_id in job_ids:
                pipe.hget(f"cx:{{{job_id}}}:job", "status")
            statuses = pipe.execute()
            if all(s in ("completed", "failed", "cancelled") for s in statuses):
                break
            time.sleep(0.1)
        t_done = time.monotonic()
        samples = sampler.stop()
    finally:
        proc.stop()

    requests = stack.llm.requests(model)
    logs = stack.llm.stream_log(model)
    outcomes = stack.llm.outcomes(model)
    intervals = [(r["received_at"], log[-1][0]) for r, log in zip(requests, logs, strict=True)
                 if log]
    peak, peak_at = peak_overlap(intervals)
    ends = {}
    for job_id in job_ids:
        events = stack.store.events_after(job_id)
        if events and events[-1]["type"] in ("job_completed", "job_failed", "job_cancelled"):
            ends[job_id] = (events[-1]["type"], events[-1]["ts"] - offset)
    completed = [t for kind, t in ends.values() if kind == "job_completed"]
    # Per job (matched by its input, which the model request carries): POST sent -> model
    # request arrived, and the stream's last chunk -> job_completed (is the worker keeping up?).
    to_request: list[float] = []
    lag: list[float] = []
    end_of = dict(zip([f"bench job {n}" for n in range(args.jobs)],
                      [ends.get(j, ("", float("nan")))[1] for j in job_ids], strict=True))
    for request, log in zip(requests, logs, strict=True):
        text = request["messages"][-1]["content"]
        key = next((k for k in submitted if text.startswith(k) and
                    not text[len(k):len(k) + 1].isdigit()), None)
        if key is None or not log:
            continue
        to_request.append(request["received_at"] - submitted[key])
        lag.append((end_of[key] - log[-1][0]) * 1000)
    durations = [b - a for a, b in intervals]
    first = samples[0]
    return {
        "mode": mode, "slots": slots, "jobs": args.jobs,
        "submit_s": t_submitted - t_submit,
        "requests": len(requests), "complete_streams": outcomes.count("complete"),
        "outcomes": {o: outcomes.count(o) for o in set(outcomes)},
        "peak": peak, "peak_after_s": peak_at - t_submit,
        "last_request_after_s": max(r["received_at"] for r in requests) - t_submit
        if requests else float("nan"),
        "to_request_p50": pct(to_request, 50), "to_request_max": max(to_request),
        "lag_p50": pct(lag, 50), "lag_max": max(lag), "matched": len(lag),
        "stream_s_p50": statistics.median(durations) if durations else float("nan"),
        "stream_s_max": max(durations) if durations else float("nan"),
        "completed": len(completed),
        "failed": sum(1 for kind, _ in ends.values() if kind != "job_completed"),
        "unfinished": sum(1 for s in statuses if s not in ("completed", "failed", "cancelled")),
        "makespan_s": (max(completed) - t_submit) if completed else float("nan"),
        "wait_s": t_done - t_submit,
        "rss_ready_mb": ready["rss_kb"] / 1024, "pss_ready_mb": ready["pss_kb"] / 1024,
        "rss_warm_mb": warm["rss_kb"] / 1024, "pss_warm_mb": warm["pss_kb"] / 1024,
        "rss_peak_mb": max(s["rss_kb"] for s in samples) / 1024,
        "pss_peak_mb": max(s["pss_kb"] for s in samples) / 1024,
        "threads_peak": max(s["threads"] for s in samples),
        "pids": ready["pids"],
        "cpu_s": cpu_seconds(first, samples[-1]),
        "cpu_busiest_1s": busiest_second(samples),
        "elapsed_s": samples[-1]["t"] - first["t"],
        "redis_cpu_s": (samples[-1]["other"]["redis"] - first["other"]["redis"]) / TICK,
        "self_cpu_s": samples[-1]["self_cpu"] - first["self_cpu"],
        "machine_busy": (samples[-1]["machine"][0] - first["machine"][0])
        / max(1, samples[-1]["machine"][1] - first["machine"][1]),
        "log": str(proc.log_path),
    }


# --------------------------------------------------------------------------- cost per token


def token_cost(stack: Stack, tokens: int = 10_000) -> dict[str, float]:
    """CPU of one thread of this process per streamed token (us), for what an agent turn does
    with each chunk: read it from the model stream (the gateway: httpx, SSE, JSON), also feed
    the parser, also log its chunks as the coordinator does (a `ChunkWriter`, flushed here in
    this thread every FLUSH_S, so that its CPU is counted). Best of 3."""
    from cortex_worker.jobs.turns.reading import CHUNK_EVENTS, FLUSH_S, _coalesce
    from cortex_worker.llm.config import ModelConfig
    from cortex_worker.llm.gateway import open_stream
    from cortex_worker.llm.stream import TextDelta
    from cortex_worker.protocol import parser as p
    from cortex_worker.store.chunk_writer import ChunkWriter

    assert stack.llm is not None
    job_id = f"bench-token-cost-{uuid.uuid4().hex[:8]}"
    stack.store.create_job(job_id, {"kind": "bench"}, 600)
    body = "<thought>" + "word " * (tokens * CHUNK_CHARS // 5) + "</thought>\n"
    model = f"cost-{uuid.uuid4().hex[:6]}"
    config = ModelConfig(base_url=stack.llm.url, model=model, api_key_env=None)
    out: dict[str, float] = {}
    writer = ChunkWriter(stack.store, 3600.0, prepare=_coalesce)  # its thread never writes
    for step in ("stream", "stream + parse", "stream + parse + log") * 3:
        stack.llm.script(model, [Turn(text=body, tokens_per_second=4000,
                                      chunk_chars=CHUNK_CHARS)])
        parser = p.StreamParser()
        count = 0
        flushed = time.monotonic()
        cpu0 = time.thread_time()
        for piece in open_stream(config, [{"role": "user", "content": "x"}]):
            if not isinstance(piece, TextDelta):
                continue
            count += 1
            if step == "stream":
                continue
            events = parser.feed(piece.text)
            if step.endswith("log"):
                writer.add(job_id, [(e.type, e.data) for e in events if e.type in CHUNK_EVENTS])
                if time.monotonic() - flushed >= FLUSH_S:
                    writer.flush(job_id)
                    flushed = time.monotonic()
        writer.flush(job_id)  # what is left, as a turn's end does
        cost = (time.thread_time() - cpu0) / max(1, count) * 1e6
        out[step] = min(out.get(step, cost), cost)
    return out


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=100, help="agent jobs at once (100)")
    parser.add_argument("--stream-s", type=float, default=5.0,
                        help="seconds each job's model stream lasts (5)")
    parser.add_argument("--tps", type=float, default=10.0,
                        help="tokens (4-character chunks) per second per stream (10)")
    parser.add_argument("--modes", default="threads,prefork,gevent",
                        help="comma-separated: threads, prefork, gevent, eventlet")
    parser.add_argument("--prefork-concurrency", type=int, default=4)
    parser.add_argument("--threads-concurrency", type=int, default=None,
                        help="`cortex worker --pool agent --concurrency N` (default: as shipped, 200)")
    parser.add_argument("--token-cost", action="store_true",
                        help="also time the CPU per streamed token of the turn's steps, in "
                             "this process (use --modes '' for this alone)")
    parser.add_argument("--listen-backlog", type=int, default=1024,
                        help="listen backlog of the fake model server (socketserver's is 5)")
    args = parser.parse_args(argv)

    stop_on_sigterm()
    print_header(f"load average {loadavg()}")
    tokens = round(args.tps * args.stream_s)
    print(f"workload: {args.jobs} agent jobs submitted at once; each one turn streaming "
          f"{tokens} tokens at {args.tps:g} tokens/s ({args.stream_s:g} s; 1 token = "
          f"{CHUNK_CHARS} characters), then a final response, no actions")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    skipped = []
    for mode in list(modes):
        if mode in ("gevent", "eventlet") and importlib.util.find_spec(mode) is None:
            modes.remove(mode)
            skipped.append(mode)
    for mode in skipped:
        print(f"{mode}: not installed in this interpreter, not measured")

    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-agent-conc-"))
    stack = Stack(workdir, listen_backlog=args.listen_backlog)
    results = []
    cost: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        print("  starting redis, fake model, api ...", flush=True)
        stack.start()
        print(f"  logs in {stack.log_dir}", flush=True)
        offset = time.time() - time.monotonic()
        for mode in modes:
            print(f"  {mode}: running {args.jobs} jobs ...", flush=True)
            res = run_mode(stack, mode, args, offset)
            results.append(res)
            print(f"  {mode}: peak {res['peak']} open streams, {res['completed']} completed in "
                  f"{res['makespan_s']:.1f} s", flush=True)
        if args.token_cost:
            print("  timing the CPU per token ...", flush=True)
            cost = token_cost(stack)
    finally:
        print("  stopping everything ...", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stack.stop()
    print(f"total wall time: {time.monotonic() - t0:.1f} s; load average at the end: "
          f"{loadavg()}\n")
    if results:
        report(results)
    if args.token_cost:
        print("\nCPU per streamed token, one thread of this process (us, best of 3, 10,000 tokens):")
        previous = 0.0
        for step, value in cost.items():
            print(f"  {step:24} {value:6.1f}  ({value - previous:+.1f})")
            previous = value
    return 0


def report(results: list[dict[str, Any]]) -> None:
    labels = {"threads": "cortex worker --pool agent (threads x{slots})",
              "prefork": "celery ... --pool prefork x{slots}"}
    rows = [("measure", *[labels.get(r["mode"], r["mode"]).format(slots=r["slots"])
                          for r in results])]

    def add(name: str, fmt: str, key: str) -> None:
        rows.append((name, *[fmt.format(r[key]) for r in results]))

    add("jobs submitted", "{}", "jobs")
    add("  submit time, 16 client threads (s)", "{:.2f}", "submit_s")
    add("peak concurrent model streams", "{}", "peak")
    add("  reached after first submit (s)", "{:.2f}", "peak_after_s")
    add("  last request arrived after (s)", "{:.2f}", "last_request_after_s")
    add("job POST sent -> its model request, p50 (s)", "{:.2f}", "to_request_p50")
    add("  max", "{:.2f}", "to_request_max")
    add("stream duration p50 (s)", "{:.2f}", "stream_s_p50")
    add("  max", "{:.2f}", "stream_s_max")
    add("last chunk sent -> job_completed, p50 (ms)", "{:.0f}", "lag_p50")
    add("  max", "{:.0f}", "lag_max")
    add("jobs completed", "{}", "completed")
    add("jobs failed", "{}", "failed")
    add("jobs unfinished", "{}", "unfinished")
    add("batch makespan (s)", "{:.1f}", "makespan_s")
    add("worker processes", "{}", "pids")
    add("RSS after start-up (MB)", "{:.0f}", "rss_ready_mb")
    add("RSS after warm-up (MB)", "{:.0f}", "rss_warm_mb")
    add("RSS peak during batch (MB)", "{:.0f}", "rss_peak_mb")
    add("PSS after start-up (MB)", "{:.0f}", "pss_ready_mb")
    add("PSS peak during batch (MB)", "{:.0f}", "pss_peak_mb")
    add("OS threads, peak", "{}", "threads_peak")
    add("worker CPU during batch (s)", "{:.1f}", "cpu_s")
    add("  sampled over (s)", "{:.1f}", "elapsed_s")
    rows.append(("  average (cores)", *[f"{r['cpu_s'] / r['elapsed_s']:.2f}" for r in results]))
    add("  busiest 1 s (cores)", "{:.2f}", "cpu_busiest_1s")
    add("redis CPU during batch (s)", "{:.1f}", "redis_cpu_s")
    add("machine CPU busy during batch (all cores)", "{:.0%}", "machine_busy")
    add("this script: fake model, polling, sampling CPU (s)", "{:.1f}", "self_cpu_s")
    table(rows)
    for r in results:
        print(f"{r['mode']}: fake-server outcomes {r['outcomes']}; worker log {r['log']}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped", file=sys.stderr)
        sys.exit(130)
