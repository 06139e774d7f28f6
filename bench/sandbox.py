"""What isolating a tool costs: sandboxed runs with and without namespaces.

Usage: python bench/sandbox.py [--runs N]

Times `run_sandboxed` (cortex_worker/sandbox/process.py) for `true` and for `python -c pass`,
first as a plain sandbox (process group, rlimits, clean environment), then in namespaces
(cortex_worker/sandbox/isolation.py) with and without a network namespace, as the sandbox
user when the bench runs as root. Each variant runs N times (default 30) after one warm-up;
the median and p90 wall times are printed, and the median overhead over the plain sandbox.
This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_header
from cortex_worker.sandbox import isolation
from cortex_worker.sandbox.isolation import Isolation, interpreter_paths
from cortex_worker.sandbox.process import run_sandboxed


def timed(argv: list[str], workspace: Path, iso: Isolation | None, runs: int) -> list[float]:
    """Wall times (ms) of `runs` sandboxed runs of `argv`, after one warm-up."""
    times = []
    for i in range(runs + 1):
        started = time.perf_counter()
        result = run_sandboxed(argv, cwd=workspace, timeout=30, isolation=iso)
        elapsed = (time.perf_counter() - started) * 1000
        if result.returncode != 0:
            raise SystemExit(f"{argv} failed ({result.returncode}): {result.stderr.decode()}")
        if i:
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    print_header(f"kernel {platform.release()}")
    reason = isolation.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"namespaces are unavailable here: {reason}")
    user = isolation.sandbox_user("nobody")
    print(f"runs:     {args.runs} per variant; tools run as uid "
          f"{user[0] if user else os.geteuid()}")
    root = Path(tempfile.mkdtemp(prefix="cortex-bench-sandbox-"))
    workspace = root / "job"
    workspace.mkdir()
    if user is not None:
        os.chown(workspace, *user)
    variants = {
        "plain sandbox": None,
        "namespaces, no network": Isolation(writable=workspace, hide=root,
                                            readable=interpreter_paths(), user=user),
        "namespaces, host network": Isolation(writable=workspace, hide=root, network=False,
                                              readable=interpreter_paths(), user=user),
    }
    try:
        for label, argv in (("true", ["true"]), ("python -c pass", [sys.executable, "-c", "pass"])):
            print(f"\n{label}")
            base = None
            for name, iso in variants.items():
                times = timed(argv, workspace, iso, args.runs)
                median = statistics.median(times)
                p90 = statistics.quantiles(times, n=10)[-1]
                base = median if base is None else base
                extra = "" if iso is None else f"   +{median - base:.1f} ms"
                print(f"  {name:<26} median {median:7.1f} ms   p90 {p90:7.1f} ms{extra}")
    finally:
        for path in sorted(root.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        root.rmdir()


if __name__ == "__main__":
    main()
