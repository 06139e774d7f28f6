"""How each Cortex process is set up as it starts: worker processes (threaded pools, prefork
parents and children) and the API switch threads every 0.5 ms, not CPython's 5 ms."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from cortex_api import server
from cortex_worker import reconciler, tasks, tracing
from cortex_worker.runtime import SWITCH_INTERVAL_S


@pytest.fixture
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.fixture
def quiet_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """No reconciler thread, no exporter, no SIGTERM handler: only the set-up under test."""
    monkeypatch.setattr(reconciler, "start", lambda *a, **k: None)
    monkeypatch.setattr(tracing, "configure", lambda *a, **k: None)
    monkeypatch.setattr(tasks, "install_sigterm_handler", lambda: None)


@pytest.mark.parametrize("hook", [tasks._init_worker, tasks._init_process])
def test_a_worker_process_switches_threads_promptly(hook: Any, default_interval: None,
                                                    quiet_start: None) -> None:
    hook(sender=None)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)


def test_the_api_switches_threads_promptly(default_interval: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    served: list[float] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: served.append(sys.getswitchinterval()))
    server.run("127.0.0.1", 0)
    assert served == [pytest.approx(SWITCH_INTERVAL_S)]
