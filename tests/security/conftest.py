"""Fixtures for the security tests: the integration session's Redis, fake model and workers
(workers do no auth, so they are shared as they are), and APIs started here with keys.

`pytest_plugins` cannot name the integration conftest from a conftest below the root, so its
fixtures are imported by name. Run together with tests/integration, each directory gets its own
session Redis and workers (fixtures are per conftest); run alone, only these start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (  # noqa: F401  (fixtures: pytest finds them by name)
    _harness_session,
    clean_redis,
    cortex_env,
    fake_anthropic,
    fake_llm,
    harness_dir,
    redis_client,
    redis_server,
    workers,
)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """These tests start real processes: mark them `integration` too."""
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)
