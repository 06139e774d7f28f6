"""How `Stack.stop` ends processes that will not stop by themselves (as Flower sometimes
will not), after their grace or, once a second stop signal came, at once: real processes,
since stopping them is the thing under test, and graces counted on the stop's own clock
(`StackClock`), not the machine's. And how `Stack.start` refuses, before it starts anything,
ports and a log directory that another stack holds."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex_api import stack as stack_module
from cortex_api.stack import (
    GRACE_S,
    STOP_SIGNALS,
    Proc,
    Stack,
    StackError,
    free_port,
    listen,
    port_in_use,
)
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


class StackClock:
    """The clock `Stack.stop` reads, in place of the `time` module in cortex_api.stack: it
    moves only when the stop sleeps between two looks at its processes (and it does sleep
    that long), so a grace is counted in the stop's own passes, however busy the machine.
    `signals`: each signal the stack sent, as (process name, signal, this clock then);
    `on_sleep`: called at the stop's first sleep (a signal that arrives while it waits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.signals: list[tuple[str, int, float]] = []
        self.on_sleep: Callable[[], None] | None = None
        send = Proc.signal

        def recorded(proc: Proc, sig: int) -> None:
            self.signals.append((proc.name, sig, self.now))
            send(proc, sig)

        monkeypatch.setattr(Proc, "signal", recorded)
        monkeypatch.setattr(stack_module, "time", self)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self.now = round(self.now + seconds, 6)
        if self.on_sleep is not None:
            call, self.on_sleep = self.on_sleep, None
            call()

    def sent(self, name: str) -> list[tuple[int, float]]:
        return [(sig, at) for who, sig, at in self.signals if who == name]


def test_stop_kills_a_group_past_its_grace_and_what_a_leader_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
        clock = StackClock(monkeypatch)
        stack.stop()
    finally:
        stack.stop()  # a no-op, unless the test failed before its own
    # SIGTERM to each group at once; the stubborn one's SIGKILL once its own grace (0.5 s)
    # was over on the stop's clock, not the default one (GRACE_S)
    (term, at_term), (kill, at_kill) = clock.sent("stubborn")
    assert (term, at_term, kill) == (signal.SIGTERM, 0.0, signal.SIGKILL)
    assert stubborn.grace <= at_kill < GRACE_S, clock.signals
    assert stubborn.popen.returncode == -signal.SIGKILL
    # the leaver's leader died of the SIGTERM; its group's SIGKILL took the child it left
    assert [sig for sig, _ in clock.sent("leaver")] == [signal.SIGTERM, signal.SIGKILL]
    assert leaver.popen.returncode == -signal.SIGTERM
    assert harness.left_behind(tree, timeout=2) == []  # the leaver's child too


def test_a_stop_signal_while_it_stops_kills_what_is_left_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second SIGTERM (SIGINT, SIGHUP) while the stack stops, as an impatient supervisor
    sends: the stop goes on, and a process inside its grace gets SIGKILL at the next pass."""
    stack = Stack(Settings(), tmp_path)
    patient = stack._spawn("patient", [sys.executable, "-c", STUBBORN])  # the default grace
    try:
        harness.wait_until(lambda: "ready" in patient.log.read_text(), timeout=15,
                           interval=0.05)
        clock = StackClock(monkeypatch)
        clock.on_sleep = lambda: stack._on_signal(signal.SIGTERM, None)  # the handler `start` sets
        stack.stop()
    finally:
        stack.stop()
    # SIGTERM, the signal during the first wait, SIGKILL at the next pass: one pass of the
    # stop's clock into a grace of GRACE_S
    assert clock.sent("patient") == [(signal.SIGTERM, 0.0), (signal.SIGKILL, 0.05)]
    assert patient.grace == GRACE_S
    assert patient.popen.returncode == -signal.SIGKILL
    assert stack.procs == []


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on, as the API of a stack already up does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _handlers() -> list[Any]:
    return [signal.getsignal(s) for s in STOP_SIGNALS]


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path, listening: int) -> None:
    logs = tmp_path / "logs"
    handlers = _handlers()
    for settings, port, flower in ((Settings(), listening, False),
                                   (Settings(flower_port=listening), free_port(), True)):
        stack = Stack(settings, logs)
        with pytest.raises(StackError, match=f"already in use on 127.0.0.1: port {listening} "):
            stack.start((), api_port=port, flower=flower)
        assert (stack.procs, stack.redis_url, stack.api_url) == ([], "", "")
        assert not logs.exists()  # no log file touched, not even the directory made
        assert _handlers() == handlers


def test_both_busy_ports_are_named(listening: int, tmp_path: Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        flower_port = other.getsockname()[1]
        stack = Stack(Settings(flower_port=flower_port), tmp_path / "logs")
        with pytest.raises(StackError) as caught:
            stack.start((), api_port=listening, flower=True)
    assert (f"port {listening} (the API, --port) and {flower_port} (Flower, CORTEX_FLOWER_PORT)"
            in str(caught.value))


def test_a_port_left_in_time_wait_by_a_stopped_stack_is_free() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's and Redis's
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end waits in TIME_WAIT
        client.close()
    assert not port_in_use(port)


def test_a_log_directory_in_use_is_refused_and_its_logs_kept(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    first = Stack(Settings(), logs)
    first._lock_log_dir()  # what `start` does first, for a stack that is up
    (logs / "api.log").write_text("the first stack's log\n")
    try:
        second = Stack(Settings(), logs)
        with pytest.raises(StackError, match="another stack keeps its logs in"):
            second.start((), api_port=free_port())
        assert second.procs == []
        assert (logs / "api.log").read_text() == "the first stack's log\n"
    finally:
        first.stop()
    third = Stack(Settings(), logs)  # released by `stop`
    third._lock_log_dir()
    third.stop()


def test_cortex_up_on_a_busy_port_says_so_and_never_that_it_is_up(tmp_path: Path,
                                                                  listening: int) -> None:
    from typer.testing import CliRunner

    from cortex_api.cli import app

    result = CliRunner().invoke(app, ["up", "--port", str(listening), "--no-flower",
                                      "--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == 1, result.output
    assert f"port {listening} (the API, --port)" in result.output
    assert "Cortex is up" not in result.output
    assert not (tmp_path / "logs").exists()


def test_the_api_port_is_held_from_the_check_on_so_no_other_process_takes_it() -> None:
    """`cortex up` binds the API's socket itself and hands it to `cortex api --fd`: a port
    picked free and bound later could be taken in between (seen: the demo's API exiting with
    'address already in use' while other suites started servers)."""
    with listen(0) as held:
        port = held.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(OSError):
            listen(port)
