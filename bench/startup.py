"""Start-up cost: the CPU time a `cortex worker` or `cortex api` uses until it is ready.

Usage: python bench/startup.py [--runs N] [--pools agent,tool,llm,relic] [--no-api] [--warm]
       [--source CHECKOUT]

Ready means what the test harness waits for (tests/harness.py): a worker answers a Celery
`stats` broadcast, the API answers `GET /healthz` with 200. One run starts a private
redis-server (free port), then each process alone, with the test stacks' manifests
(tests/manifests) and environment, waits until it is ready, reads its CPU time (user + system,
Linux /proc: every process of its group, plus the children they reaped, such as an MCP server
started to list its tools), and stops it. The figures are CPU seconds, not wall time: they
hold on a busy machine, and under `nice`.

Each run uses a fresh Redis (FLUSHALL), so the first process of a run finds nothing another
left there, as in a test stack; `--warm` keeps what the earlier processes of the run left.

This is a measurement, not a test; it exits 0 once it has measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import print_header, stop_on_sigterm  # noqa: E402
from tests import harness  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """user + system time of `pids` and of the children they reaped (/proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / TICKS


def environment(redis_url: str, workspace: str, source: Path = ROOT) -> dict[str, str]:
    """What tests/integration/conftest.py's `cortex_env` gives the stack's processes (the
    code imported from `source`, first on PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CORTEX_", "CELERY_")) and k != "REDIS_URL"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(source)
    env["PYTHONUNBUFFERED"] = "1"
    env["CORTEX_REDIS_URL"] = redis_url
    env["CORTEX_MANIFESTS"] = str(ROOT / "tests" / "manifests")
    env["CORTEX_WORKSPACE_ROOT"] = workspace
    env["CORTEX_TEST_LLM_URL"] = "http://127.0.0.1:9/v1"
    env["CORTEX_TEST_ANTHROPIC_URL"] = "http://127.0.0.1:9"
    env["CORTEX_DOCUMENT_MODEL"] = json.dumps(
        {"base_url": "${CORTEX_TEST_LLM_URL}", "model": "documents", "api_key_env": None})
    return env


def measure(what: str, env: dict[str, str], log_dir: str) -> float:
    if what == "api":
        proc = harness.start_api(env, log_dir=log_dir, cwd=log_dir)
    else:
        proc = harness.start_worker(what, env, log_dir=log_dir, cwd=log_dir)
    try:
        return cpu_seconds(proc.members())
    finally:
        proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pools", default="agent,tool,llm,relic")
    parser.add_argument("--no-api", action="store_true")
    parser.add_argument("--warm", action="store_true",
                        help="keep Redis between the processes of a run")
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="run the processes on the code of this checkout (a git worktree "
                             "of another commit, to compare)")
    args = parser.parse_args()
    stop_on_sigterm()
    print_header()
    order = [*(["api"] if not args.no_api else []), *args.pools.split(",")]
    seen: dict[str, list[float]] = {what: [] for what in order}
    log_dir = tempfile.mkdtemp(prefix="cortex-startup-")
    with harness.RedisServer() as redis_server:
        client = redis_server.client()
        env = environment(redis_server.url, tempfile.mkdtemp(prefix="cortex-startup-ws-"),
                          args.source.resolve())
        for run in range(args.runs):
            for what in order:
                if not args.warm or what == order[0]:
                    client.flushall()
                seen[what].append(measure(what, env, log_dir))
            print(f"run {run + 1}: " + ", ".join(f"{w} {seen[w][-1]:.2f}" for w in order),
                  flush=True)
        client.close()
    print(f"CPU seconds until ready (user+sys), median of {args.runs}:")
    for what, values in seen.items():
        print(f"  {what:6} {statistics.median(values):6.2f}  (min {min(values):.2f}, "
              f"max {max(values):.2f})")
    print(f"  total  {sum(statistics.median(v) for v in seen.values()):6.2f}")
    print(f"logs: {log_dir}")


if __name__ == "__main__":
    main()
