#!/usr/bin/env python3
"""Run the chaos-under-load test (tests/chaos/test_load_faults.py) N times, outside CI, and
print each run's figures and the worst case.

    .venv/bin/python scripts/chaos_loop.py              # 20 runs
    .venv/bin/python scripts/chaos_loop.py -n 50 --stop-on-failure
    .venv/bin/python scripts/chaos_loop.py -n 5 -- -x   # arguments after -- go to pytest

Each run is a fresh pytest process (its own Redis, workers, API and fake model). The test
writes its figures to the JSON file named by `CORTEX_CHAOS_FIGURES`; the whole output of every
run is kept in the log directory (`--logs`, default a new temporary directory), with, for a
failed run, the pytest base temp dir (`run-NNN-stack/`: every process's log, Redis's data
dir), and a failed run's first assertion lines are printed. Re-run one with the same job shapes with
`CORTEX_CHAOS_SEED=<seed> .venv/bin/python -m pytest -q tests/chaos/test_load_faults.py -k load`.
Exit status: 0 if every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/chaos/test_load_faults.py::test_load_under_faults"
RECOVERY = "last fault -> last completion (s)"
RERUNS = "actions started more than once"
MOST = "most starts of one action"
UNCLAIMED = "action_redriven of queued, unclaimed actions"


def default_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_once(number: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    figures_path = logs / f"run-{number:03d}.json"
    log_path = logs / f"run-{number:03d}.log"
    stack_dir = logs / f"run-{number:03d}-stack"  # process logs and Redis's files
    env = {**os.environ, "CORTEX_CHAOS_FIGURES": str(figures_path)}
    command = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--basetemp={stack_dir}", TEST, *args.pytest]
    began = time.monotonic()
    with log_path.open("w") as log:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              check=False).returncode
    wall = time.monotonic() - began
    if code == 0 and not args.keep:
        shutil.rmtree(stack_dir, ignore_errors=True)
    figures: dict[str, Any] = {}
    if figures_path.exists():
        figures = json.loads(figures_path.read_text())
    output = log_path.read_text(errors="replace")
    errors = [line for line in output.splitlines() if line.startswith("E ")][:args.error_lines]
    return {"run": number, "passed": code == 0, "code": code, "wall (s)": round(wall, 1),
            "figures": figures, "errors": errors, "log": str(log_path),
            "stack": str(stack_dir)}


def line(result: dict[str, Any]) -> str:
    f = result["figures"]
    warnings = {k.removeprefix("warnings "): v for k, v in f.items() if k.startswith("warnings ")}
    return (f"run {result['run']:3d}: {'passed' if result['passed'] else 'FAILED'} "
            f"in {result['wall (s)']:.0f} s; seed {f.get('seed', '?')}; jobs {f.get('jobs', '?')}; "
            f"faults {f.get('faults', '?')} (worker kills {f.get('worker kills', '?')}, "
            f"crashed {f.get('workers crashed', '?')}); "
            f"last fault -> last completion {f.get(RECOVERY, '?')} s; "
            f"re-run actions {f.get(RERUNS, '?')} (most starts {f.get(MOST, '?')}); "
            f"warnings {warnings} ({UNCLAIMED}: {f.get(UNCLAIMED, '?')}); slowest worker start "
            f"{f.get('slowest worker start (s)', '?')} s; starts sent again after begin "
            f"{f.get('starts sent again after begin', '?')}; workers paused and woken "
            f"{f.get('workers paused and woken', '?')}, their writes refused {stale(f)}")


def stale(figures: dict[str, Any]) -> dict[str, Any]:
    """The writes of woken workers the store refused (fencing), by what was written."""
    return {k.removeprefix("stale writes refused "): v for k, v in figures.items()
            if k.startswith("stale writes refused ")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=20, help="how many runs (20)")
    parser.add_argument("--logs", type=Path, default=None, help="where to keep each run's output")
    parser.add_argument("--python", default=default_python(), help="the interpreter to run")
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument("--keep", action="store_true",
                        help="keep the stack's files of passed runs too (failed runs' are kept)")
    parser.add_argument("--error-lines", type=int, default=12,
                        help="assertion lines printed for a failed run (12)")
    parser.add_argument("pytest", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="chaos-loop-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{args.runs} run(s) of {TEST}; output of each run in {logs}", flush=True)
    results = []
    for number in range(1, args.runs + 1):
        result = run_once(number, args, logs)
        results.append(result)
        print(line(result), flush=True)
        for error in result["errors"]:
            print(f"        {error[:300]}", flush=True)
        if not result["passed"]:
            print(f"        log: {result['log']}; every process's log and Redis's files: "
                  f"{result['stack']}", flush=True)
            if args.stop_on_failure:
                break

    measured = [r for r in results if r["figures"].get(RECOVERY) is not None]
    failed = [r for r in results if not r["passed"]]
    print(f"\n{len(results)} run(s), {len(results) - len(failed)} passed, {len(failed)} failed"
          + (f" (runs {', '.join(str(r['run']) for r in failed)})" if failed else ""))
    if measured:
        worst = max(measured, key=lambda r: r["figures"][RECOVERY])
        recoveries = sorted(r["figures"][RECOVERY] for r in measured)
        print(f"last fault -> last completion (s): worst {worst['figures'][RECOVERY]} (run "
              f"{worst['run']}), median {recoveries[len(recoveries) // 2]}, "
              f"best {recoveries[0]}")
        most = max(measured, key=lambda r: r["figures"].get(RERUNS, 0))
        print(f"actions started more than once: worst {most['figures'].get(RERUNS)} (run "
              f"{most['run']}), total {sum(r['figures'].get(RERUNS, 0) for r in measured)}; "
              f"most starts of one action {max(r['figures'].get(MOST, 0) for r in measured)}")
        kinds = sorted({k for r in measured for k in r["figures"] if k.startswith("warnings ")})
        for kind in kinds:
            values = [r["figures"].get(kind, 0) for r in measured]
            print(f"{kind}: worst {max(values)}, total {sum(values)}")
        unclaimed = [r["figures"].get(UNCLAIMED, 0) for r in measured]
        print(f"{UNCLAIMED}: worst {max(unclaimed)}, total {sum(unclaimed)}")
        starts = [r["figures"].get("slowest worker start (s)", 0) for r in measured]
        print(f"slowest worker start (s): worst {max(starts)}")
        print("starts sent again after begin: total "
              f"{sum(r['figures'].get('starts sent again after begin', 0) for r in measured)}")
        refused: dict[str, int] = {}
        for r in measured:
            for write, n in stale(r["figures"]).items():
                refused[write] = refused.get(write, 0) + n
        print(f"workers paused and woken: total "
              f"{sum(r['figures'].get('workers paused and woken', 0) for r in measured)}; "
              f"their writes refused (fencing), total: {refused}")
        crashed = sum(r["figures"].get("workers crashed", 0) for r in measured)
        print(f"workers crashed: total {crashed}")
        print(f"run time (s): worst {max(r['wall (s)'] for r in results)}, "
              f"median {sorted(r['wall (s)'] for r in results)[len(results) // 2]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
