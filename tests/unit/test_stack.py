"""How `Stack.stop` ends processes that will not stop by themselves (as Flower sometimes
will not): real processes, since stopping them is the thing under test."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cortex_api.stack import GRACE_S, Stack
from cortex_worker.settings import Settings
from tests import harness

pytestmark = pytest.mark.unit

IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
STUBBORN = IGNORES_SIGTERM.replace("time.sleep(60)", "print('ready', flush=True); time.sleep(60)")
# Dies of SIGTERM at once, but leaves a child in its process group that ignores it.
LEAVER = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {IGNORES_SIGTERM!r}])
time.sleep(0.5)  # the child has set its handler
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_kills_a_group_past_its_grace_and_what_a_leader_left_behind(tmp_path: Path) -> None:
    stack = Stack(Settings(), tmp_path)
    stubborn = stack._spawn("stubborn", [sys.executable, "-c", STUBBORN], grace=0.5)
    leaver = stack._spawn("leaver", [sys.executable, "-c", LEAVER])
    try:
        harness.wait_until(lambda: all("ready" in p.log.read_text() for p in (stubborn, leaver)),
                           timeout=15, interval=0.05)
        groups = {stubborn.popen.pid, leaver.popen.pid}
        tree = {pid: info for pid, info in harness.process_tree(os.getpid()).items()
                if info[1] in groups}
        assert len(tree) == 3, tree
        started = time.monotonic()
        stack.stop()
        took = time.monotonic() - started
    finally:
        stack.stop()  # a no-op, unless the test failed before its own
    assert 0.5 <= took < GRACE_S, took  # the stubborn one's grace, not the default one
    assert stubborn.popen.returncode == -signal.SIGKILL
    assert leaver.popen.returncode == -signal.SIGTERM
    assert harness.left_behind(tree, timeout=2) == []  # the leaver's child too
