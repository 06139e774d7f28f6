"""A steady stream of jobs for over two minutes while the memory of every process is sampled.

`bench/soak.py --minutes 10` is the long version (docs/reliability.md, "Load"). Bound: after a
30 s warm-up, each Cortex process group's last RSS sample is at most its first post-warm-up
sample × 1.3 + 20 MB.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

SECONDS = 120  # "at least two minutes"
WARMUP_S = 30


def test_soak_memory_stays_bounded(load_stack: Any, soak_module: ModuleType) -> None:
    result = soak_module.run_soak(load_stack, SECONDS, clients=4, interval=10)
    text, ok = soak_module.report(result, WARMUP_S)
    print("\n" + text)
    assert result.jobs > 100 and result.completed == result.jobs, result.failures
    growth = result.growth(WARMUP_S)
    assert set(growth) == {"api", "worker-agent", "worker-tool"}
    assert all(g["ok"] for g in growth.values()), growth
    assert ok
