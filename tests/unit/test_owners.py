"""Owners of leases and containers (cortex_worker.recovery.owners): which holders are known dead."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cortex_worker.recovery.owners import HOST, dead_here, owner

pytestmark = pytest.mark.unit


def test_this_process_is_alive() -> None:
    assert owner() == f"{HOST}:{os.getpid()}"
    assert not dead_here(owner())


def test_an_exited_process_and_an_unreaped_zombie_are_dead() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # exited, not reaped yet: a zombie
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.01)
    assert dead_here(f"{HOST}:{child.pid}")
    child.wait()
    assert dead_here(f"{HOST}:{child.pid}")


def test_other_hosts_and_garbage_are_never_known_dead() -> None:
    assert not dead_here(f"elsewhere-{HOST}:1")
    assert not dead_here("")
    assert not dead_here(f"{HOST}:not-a-pid")
