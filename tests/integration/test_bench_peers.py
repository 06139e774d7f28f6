"""bench/peers.py end to end in its quickest setting: it starts its own stack, runs every
variant and workload once, prints its tables and stops everything (about 10 s on 2 cores).

Only that it runs is checked, not its figures: those depend on the machine's load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers.py"
QUICK = ["--runs", "1", "--warmup", "0", "--ttft", "0.05", "--tps", "500",
         "--sleep-scale", "0.1"]


def test_peers_benchmark_runs_end_to_end() -> None:
    proc = subprocess.Popen([sys.executable, str(PEERS), *QUICK], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script stops its Redis, workers and API itself
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"bench/peers.py did not finish within 180 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    for workload in ("A four parallel lookups", "B sequential ReAct"):
        for variant in ("LangGraph", "Cortex native", "Cortex protocol"):
            assert f"{workload}, {variant}:" in out, out[-4000:]
    assert "where the time over the own ideal goes" in out
    assert "action_started -> lookup runs (sandbox)" in out
    assert "stopping everything" in out
