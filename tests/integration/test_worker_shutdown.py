"""A worker stops what its process started when it stops: the relic a relic worker started is
stopped by that worker at its warm shutdown (the `services` step of
`cortex_worker.worker.steps`), and its pid record is gone.

The stack here is its own (Redis, API, agent and relic workers): the test stops its relic
worker, which the session's tests need.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex_api.client import Client
from tests import harness


@pytest.fixture
def stack(cortex_env: dict[str, str], tmp_path: Path
          ) -> Iterator[tuple[str, harness.Process, Path]]:
    """The API's URL, the relic worker, and the workspace root of the stack's processes."""
    root = tmp_path / "workspace"
    with harness.RedisServer(log_dir=tmp_path, data_dir=tmp_path / "redis") as redis:
        env = {**cortex_env, "CORTEX_REDIS_URL": redis.url, "CORTEX_WORKSPACE_ROOT": str(root)}
        workers = harness.start_workers({"agent": None, "relic": None}, env, log_dir=tmp_path,
                                        cwd=tmp_path)
        try:
            with harness.api_running(env, log_dir=tmp_path, cwd=tmp_path) as api:
                yield api.url, workers["relic"], root
        finally:
            harness.stop_all(processes=list(workers.values()))


def test_a_relic_is_stopped_by_its_worker_at_shutdown(
        stack: tuple[str, harness.Process, Path]) -> None:
    url, relic_worker, root = stack
    body = json.dumps({"name": "echo.echo", "parameters": {"message": "hi"}})
    with Client(url) as client:
        job = client.submit_document(f'<action type="relic" id="e">{body}</action>\n')
        assert client.wait(job.id, timeout=60).status == "completed"
    records = list((root / "relics" / "pids").glob("echo.*.json"))
    assert len(records) == 1
    pid = json.loads(records[0].read_text())["pid"]

    assert relic_worker.stop(timeout=30, sig=signal.SIGTERM) == 0  # a warm shutdown
    assert f"relic echo (pid {pid}) stopped: worker shutdown" in relic_worker.log_text()
    assert not list((root / "relics" / "pids").glob("*.json"))
