"""What isolating a tool costs: sandboxed runs with and without namespaces, cold and warm.

Usage: python bench/sandbox.py [--runs N] [--gap-ms MS]

Times `run_sandboxed` (cortex_worker/sandbox/process.py) for `true` and for `python -c pass`,
first as a plain sandbox (process group, rlimits, clean environment), then in namespaces
(cortex_worker/sandbox/isolation.py) with and without a network namespace, as the sandbox
user when the bench runs as root. Then the cost a python tool call adds: a function that does
nothing, called through the python runner started cold (`run_sandboxed`: a new interpreter
per call) and warm (`run_warm`: forked from a zygote that imported the module,
cortex_worker/sandbox/warm.py), without namespaces and in them. Two modules: `os:getpid`
(stdlib only) and a `@tool` function (its zygote holds pydantic, a larger process to fork).
Each variant runs N times (default 30) after one warm-up (which starts the zygote); the median
and p90 wall times are printed. Tool calls come back to back, or MS apart (`--gap-ms`, as an
agent's calls are apart by a model turn): a warm runner sets the next call's sandbox up as
soon as it hands one out, and a call that comes sooner waits for that set-up to finish. The function's own work is microseconds, so a call's wall time
is what the sandbox adds to it. Last, the `python` built-in (the snippet tool) against the
`echo` built-in, both called as a worker calls them, in namespaces: the snippet's median
overhead over `echo`, warm (its runner forked from a zygote) and cold (a new interpreter per
call, its fallback), and the ratio of the two (goal: warm at most 10 ms over `echo`). This is
a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_header
from cortex_worker.sandbox import isolation
from cortex_worker.sandbox.function_main import parse_last_line
from cortex_worker.sandbox.isolation import Isolation, interpreter_paths
from cortex_worker.sandbox.process import SandboxResult, run_sandboxed
from cortex_worker.sandbox.warm import RUNNER, run_warm
from cortex_worker.settings import Settings
from cortex_worker.tools import builtin, sandboxed
from cortex_worker.tools.context import ToolContext

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL_MODULE = """from cortex_worker.tools.function import tool


@tool
def noop() -> None:
    \"\"\"Does nothing.\"\"\"
"""


def timed(argv: list[str], workspace: Path, iso: Isolation | None, runs: int,
          run: Callable[..., SandboxResult] = run_sandboxed,
          env: dict[str, str] | None = None, gap_s: float = 0) -> list[float]:
    """Wall times (ms) of `runs` sandboxed runs of `argv`, after one warm-up."""
    times = []
    for i in range(runs + 1):
        time.sleep(gap_s)
        started = time.perf_counter()
        result = run(argv, cwd=workspace, timeout=30, isolation=iso, env=env,
                     stdin=b"{}" if env else None)
        elapsed = (time.perf_counter() - started) * 1000
        if result.returncode != 0 or (env and not (parse_last_line(result.stdout) or {}).get("ok")):
            raise SystemExit(f"{argv} failed ({result.returncode}): {result.stdout.decode()} "
                             f"{result.stderr.decode()}")
        if i:
            times.append(elapsed)
    return times


def tool_calls(root: Path, workspace: Path, user: tuple[int, int] | None, runs: int,
               gap_s: float) -> None:
    """Per-call cost of a python tool that does nothing: cold and warm runner, with and
    without namespaces."""
    modules = root / "modules"
    modules.mkdir(mode=0o755)
    (modules / "benchtools.py").write_text(TOOL_MODULE)
    paths = (modules, REPO_ROOT)
    env = {"PYTHONPATH": os.pathsep.join(map(str, paths)), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONIOENCODING": "utf-8"}
    iso = Isolation(writable=workspace, hide=root, readable=(*interpreter_paths(), *paths),
                    user=user)
    print(f"\npython tool call (a function that does nothing), {gap_s * 1000:g} ms apart: "
          "cold runner vs warm runner")
    for entrypoint in ("os:getpid", "benchtools:noop"):
        argv = [sys.executable, "-P", "-s", "-m", RUNNER, entrypoint]
        for label, variant in (("no namespaces", None), ("namespaces, no network", iso)):
            row = []
            for run in (run_sandboxed, run_warm):
                times = timed(argv, workspace, variant, runs, run, env, gap_s)
                row.append(f"median {statistics.median(times):6.1f} ms  p90 "
                           f"{statistics.quantiles(times, n=10)[-1]:6.1f} ms")
            print(f"  {entrypoint:<16} {label:<24} cold: {row[0]}   warm: {row[1]}")


def snippet_tool(root: Path, runs: int, gap_s: float) -> None:
    """The `python` built-in's median overhead over `echo`, warm and cold, and their ratio."""
    workspaces = root / "workspaces"
    workspaces.mkdir(mode=0o755)
    ctx = ToolContext.for_job(Settings(workspace_root=workspaces, http_allow_hosts=[],
                                       sandbox_isolation="required"), "bench-job", "act-1",
                              timeout=30)
    code = {"code": "x = 6 * 7\nx"}
    stdin = json.dumps(code).encode()

    def cold() -> None:  # what builtin.python does, on the cold runner
        sandboxed.run(builtin.SNIPPET, ctx, limits=builtin.PYTHON_LIMITS, stdin=stdin,
                      env=builtin.PYTHON_ENV)

    medians = {}
    for label, call in (("echo", lambda: builtin.echo(code, ctx)),
                        ("python, warm", lambda: builtin.python(code, ctx)),
                        ("python, cold", cold)):
        times = []
        for i in range(runs + 1):  # the first starts the zygote
            time.sleep(gap_s)
            started = time.perf_counter()
            call()
            if i:
                times.append((time.perf_counter() - started) * 1000)
        medians[label] = statistics.median(times)
    warm_over = medians["python, warm"] - medians["echo"]
    cold_over = medians["python, cold"] - medians["echo"]
    print(f"\nthe python built-in against echo, in namespaces, {gap_s * 1000:g} ms apart "
          f"(median of {runs})")
    print(f"  echo {medians['echo']:.3f} ms; python warm {medians['python, warm']:.1f} ms, "
          f"cold {medians['python, cold']:.1f} ms")
    print(f"  over echo: warm +{warm_over:.1f} ms (goal <= 10 ms: "
          f"{'met' if warm_over <= 10 else 'missed'}), cold +{cold_over:.1f} ms; "
          f"cold/warm {cold_over / warm_over:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=0)
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
        tool_calls(root, workspace, user, args.runs, args.gap_ms / 1000)
        snippet_tool(root, args.runs, args.gap_ms / 1000)
    finally:
        for path in sorted(root.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        root.rmdir()


if __name__ == "__main__":
    main()
