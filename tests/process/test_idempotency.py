"""An MCP tool call carries its action's attempt in `_meta`, and a docker tool's container
gets it as environment variables. The MCP server is a real process
(tests/mcp_servers/meta_echo.py, which answers the `_meta` it was sent); the docker check
reads the container's configuration, so it needs no daemon."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex_worker.services.mcp.spec import MCPServerSpec, tool_specs
from cortex_worker.services.pool import service_pools
from cortex_worker.settings import Settings
from cortex_worker.tools.attempt import current
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.runtime import run_tool
from cortex_worker.tools.spec import ToolSpec
from tests.manifest_helpers import REPO_ROOT

pytestmark = pytest.mark.process

META_ECHO = REPO_ROOT / "tests" / "mcp_servers" / "meta_echo.py"


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[ToolContext]:
    """The second attempt of action `pay` of job `job-7`; MCP servers it starts are stopped."""
    context = ToolContext.for_job(Settings(workspace_root=tmp_path), "job-7", "pay", timeout=20)
    try:
        yield dataclasses.replace(context, attempt=2)
    finally:
        service_pools().stop_all()


def test_an_mcp_tool_call_carries_the_attempt_in_meta(ctx: ToolContext) -> None:
    server = MCPServerSpec(name="meta_echo", command=[sys.executable, str(META_ECHO)],
                           tools=[{"name": "meta", "parameters": {"type": "object"}}])
    [spec] = tool_specs(server, None)
    assert run_tool(spec, {}, ctx) == {"io.cortex/idempotency_key": "job-7:pay",
                                       "io.cortex/attempt": 2}
    with pytest.raises(LookupError):  # the call's attempt is the call's only
        current()


def test_a_docker_tool_gets_the_attempt_in_its_environment(ctx: ToolContext) -> None:
    docker = pytest.importorskip("cortex_worker.sandbox.docker")
    spec = ToolSpec(name="box", runtime="docker", image="alpine:3",
                    env={"CORTEX_ATTEMPT": "forged", "MINE": "1"})
    create, _ = docker.container_config(spec, ["true"], ctx)
    assert create["environment"] == {"MINE": "1", "CORTEX_JOB_ID": "job-7",
                                     "CORTEX_ACTION_ID": "pay", "CORTEX_ATTEMPT": "2",
                                     "CORTEX_IDEMPOTENCY_KEY": "job-7:pay"}
