"""Load and soak tests: their own Redis, `agent` (8 threads) and `tool` (4) workers and API.

Part of the default run (`make test`); every test here is marked `load` and `integration`,
so `pytest -m "not load"` leaves them out. The stack is bench/soak.py's `start_stack`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import harness

HERE = Path(__file__).resolve().parent
SOAK_PATH = HERE.parent.parent / "bench" / "soak.py"
POOLS = {"agent": 8, "tool": 4}


def load_soak_module() -> ModuleType:
    """bench/soak.py as a module (bench/ is not a package)."""
    if "cortex_bench_soak" in sys.modules:
        return sys.modules["cortex_bench_soak"]
    spec = importlib.util.spec_from_file_location("cortex_bench_soak", SOAK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cortex_bench_soak"] = module
    spec.loader.exec_module(module)
    return module


def _is_here(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(HERE)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "load: load and soak tests (own stack, minutes)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_here(item):
            item.add_marker(pytest.mark.load)
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failing load test, attach the tail of every live harness process's log."""
    report = yield
    if report.failed and _is_here(item):
        procs = harness.live_processes()
        if procs:
            report.sections.append(("harness process logs",
                                    "\n".join(p.describe(40) for p in procs)))
    return report


@pytest.fixture(scope="session")
def soak_module() -> ModuleType:
    return load_soak_module()


@pytest.fixture(scope="session")
def load_stack(soak_module: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Redis, workers (agent 8 threads, tool 4) and the API, for this directory's session."""
    harness.reap_orphans()
    stack = soak_module.start_stack(tmp_path_factory.mktemp("load"), POOLS)
    try:
        yield stack
    finally:
        stack.stop()
