"""One table of pools (cortex_worker.pools): the Celery queues, `cortex worker`'s Celery
options and the pools `cortex up` starts are all read from it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cortex_api import cli, stack
from cortex_worker import app as celery_app
from cortex_worker import pools
from cortex_worker.settings import AGENT_THREADS

pytestmark = pytest.mark.unit


def test_the_table() -> None:
    assert [(p.name, p.threaded, p.concurrency, p.up) for p in pools.TABLE] == [
        ("agent", True, AGENT_THREADS, True),
        ("tool", False, None, True),
        ("llm", True, 50, True),
        ("relic", True, 8, True),
        ("docker", False, None, False),
    ]
    assert all(p.description for p in pools.TABLE)
    assert pools.UP == ("agent", "tool", "llm", "relic")


def test_the_celery_queues_are_the_pools_lanes() -> None:
    """Each pool's queue is its lanes (fairness across tenants), lane 0 named as the pool;
    a lane's routing key is its name, on its pool's exchange."""
    queues = celery_app.app.conf.task_queues
    assert [q.name for q in queues] == [lane for pool in pools.NAMES for lane in pools.lanes(pool)]
    assert all(q.routing_key == q.name and q.exchange.name == q.name.partition(".")[0]
               for q in queues)
    assert pools.lanes("tool")[:3] == ("tool", "tool.1", "tool.2")
    assert len(pools.lanes("tool")) == pools.LANES


def test_cortex_up_starts_the_default_pools() -> None:
    assert stack.Stack.start.__defaults__ is not None
    assert stack.Stack.start.__defaults__[0] == pools.UP
    result = CliRunner().invoke(cli.app, ["up", "--help"], env={"COLUMNS": "200"})
    assert "[default: agent,tool,llm,relic]" in result.output


@pytest.mark.parametrize(("pool", "options"), [
    ("agent", ["--pool=threads", f"--concurrency={AGENT_THREADS}"]),
    ("llm", ["--pool=threads", "--concurrency=50"]),
    ("relic", ["--pool=threads", "--concurrency=8"]),
    ("docker", []),
])
def test_cortex_worker_runs_each_pool_as_the_table_says(
        pool: str, options: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(celery_app.app, "worker_main", started.append)
    result = CliRunner().invoke(cli.app, ["worker", "--pool", pool])
    assert result.exit_code == 0, result.output
    argv = started[0]
    assert argv[:3] == ["worker", "-Q", ",".join(pools.lanes(pool))]  # every lane of it
    assert [a for a in argv if a.startswith(("--pool=", "--concurrency="))] == options


def test_cortex_worker_refuses_a_pool_not_in_the_table() -> None:
    result = CliRunner().invoke(cli.app, ["worker", "--pool", "gpu"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "unknown pool 'gpu'; choose one of agent, tool, llm, relic, docker" in result.output
