"""What every benchmark script shares: percentiles, its header, and a clean Ctrl-C on SIGTERM.

Scripts put the repository root on `sys.path` first, then `from bench.common import ...`.
"""

from __future__ import annotations

import datetime
import os
import platform
import signal
from collections.abc import Sequence


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def print_header(*machine: str) -> None:
    """Print the date, the Python and the machine (with `machine` details appended)."""
    details = "".join(f", {item}" for item in machine)
    print(f"date:     {datetime.date.today().isoformat()}")
    print(f"python:   {platform.python_implementation()} {platform.python_version()}")
    print(f"machine:  {platform.machine()}, {os.cpu_count()} cores{details}")


def stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so the script's cleanup runs (main thread)."""
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
