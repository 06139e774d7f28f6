"""What building an agent's protocol grammar costs, in each flavour.

Usage: python bench/grammar.py [--agent NAME] [--builds N]

Builds the grammar of one agent of the example manifests (examples/manifests; default `demo`:
seven tools, among them `python` and `load_docs`, and the `kv` relic's operations) with
`build_grammar` (cortex_worker/llm/grammar.py), N times in each flavour (default 40), after one
untimed build. A coordinator builds an agent's grammar once per process and flavour
(`_grammar` in cortex_worker/jobs/turns/loop.py), before the agent's first turn there: its
cost is added to that turn. Printed per flavour: the grammar's size, and the median and
slowest build in wall time and in this thread's CPU time (which other processes on a busy
machine do not inflate). This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_header
from cortex_worker.llm import grammar as gr
from cortex_worker.manifests.loader import load_registry

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "manifests"
TARGET_MS = 50.0  # CPU per build: next to nothing against a model turn


def size_of(grammar: gr.Grammar | None) -> int:
    """The grammar's characters (a structural tag: its JSON's)."""
    return len(grammar if isinstance(grammar, str) else json.dumps(grammar))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agent", default="demo", help="an agent of examples/manifests")
    ap.add_argument("--builds", type=int, default=40, help="timed builds per flavour")
    args = ap.parse_args()

    registry = load_registry(EXAMPLES)
    agent = registry.agents[args.agent]
    callables = len(gr.agent_targets(agent, registry))
    print_header()
    print(f"agent:    {agent.name} ({callables} callables: tools {', '.join(agent.tools)}; "
          f"relics {', '.join(agent.relics) or 'none'}), {args.builds} builds a flavour")
    print()
    print(f"{'flavour':<16} {'chars':>8} {'wall p50 (ms)':>14} {'wall max':>9} "
          f"{'CPU p50 (ms)':>13} {'CPU max':>8}")
    worst = 0.0
    for flavour in gr.FLAVOURS:
        size = size_of(gr.build_grammar(agent, registry, flavour))  # untimed: imports, caches
        walls: list[float] = []
        cpus: list[float] = []
        for _ in range(args.builds):
            wall, cpu = time.perf_counter(), time.thread_time()
            gr.build_grammar(agent, registry, flavour)
            cpus.append((time.thread_time() - cpu) * 1000)
            walls.append((time.perf_counter() - wall) * 1000)
        worst = max(worst, statistics.median(cpus))
        print(f"{flavour:<16} {size:>8,} {statistics.median(walls):>14.2f} {max(walls):>9.2f} "
              f"{statistics.median(cpus):>13.2f} {max(cpus):>8.2f}")
    verdict = "meets" if worst < TARGET_MS else "MISSES"
    print(f"\ntarget: < {TARGET_MS:g} ms of CPU per build (median), every flavour: {verdict} "
          f"(worst {worst:.2f} ms)")


if __name__ == "__main__":
    main()
