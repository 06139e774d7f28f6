"""Traces from real processes: an API and workers with `OTEL_EXPORTER_OTLP_ENDPOINT` set,
exporting to an OTLP/HTTP collector on loopback (`tests/otlp_collector.py`).

The stack here is its own (Redis, API, agent and tool workers): the session's processes run
without an endpoint, as shipped, and export nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex_api.client import Client
from cortex_api.models import JobOptions
from cortex_worker.observability.tracing import job_ids
from tests import harness
from tests.fake_llm import FakeLLM, Turn
from tests.otlp_collector import Collector, ReceivedSpan


@pytest.fixture(scope="module")
def traced(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[tuple[Collector, str]]:
    """A collector, and the URL of an API whose processes export to it."""
    with Collector() as collector, harness.RedisServer(log_dir=harness_dir / "otel-redis",
                                                       data_dir=harness_dir / "otel-redis") as redis:
        env = {**cortex_env, "CORTEX_REDIS_URL": redis.url,
               "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        workers = harness.start_workers({"agent": None, "tool": 2}, env, log_dir=harness_dir,
                                        cwd=harness_dir)
        api = harness.start_api(env, log_dir=harness_dir, cwd=harness_dir)
        try:
            yield collector, api.url
        finally:
            harness.stop_all(processes=[api, *workers.values()])


def action(ident: str, name: str, params: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "parameters": params})
    return f'<action type="tool" mode="async" id="{ident}">{body}</action>'


def test_one_trace_per_job_across_processes(traced: tuple[Collector, str],
                                            fake_llm: FakeLLM) -> None:
    collector, url = traced
    model = f"otel-{uuid.uuid4().hex[:8]}"
    fake_llm.script(model, [
        Turn(text="<thought>Two things at once." + action("sum", "calculator",
             {"expression": "19 + 23"}) + action("say", "echo", {"message": "hi"})
             + "</thought>", tokens_per_second=2000.0),
        Turn(text='<response final="true">$sum</response>', tokens_per_second=2000.0),
    ])
    with Client(url) as client:
        job_id = client.submit_agent("tester", "Add.", options=JobOptions(model=model)).id
        assert client.wait(job_id, timeout=60).status == "completed"
    trace_id, root_id = (format(n, f"0{w}x") for n, w in zip(job_ids(job_id), (32, 16),
                                                                  strict=True))

    def spans() -> list[ReceivedSpan]:
        return [s for s in collector.received() if s.trace_id == trace_id]

    def arrived() -> bool:
        """The root, both tools' spans, and every span's parent: each process exports its
        spans in its own batches, so a child can arrive before its parent, and one tool's
        span after the other's."""
        got = spans()
        ids = {s.span_id for s in got}
        return (any(s.name == "job" for s in got)
                and sum(s.name == "tool calculator" for s in got) == 1
                and sum(s.name == "tool echo" for s in got) == 1
                and all(not s.parent_id or s.parent_id in ids for s in got))

    harness.wait_until(arrived, timeout=20, message="the job's spans at the collector")
    got = spans()
    by_id = {s.span_id: s for s in got}
    root = next(s for s in got if s.name == "job")
    assert root.span_id == root_id and root.parent_id == ""
    assert root.attributes["cortex.job.status"] == "completed"
    assert root.attributes["cortex.agent"] == "tester" and not root.error
    # every span of the job hangs, through its parents, under the root
    for span in got:
        chain, seen = span, set()
        while chain.parent_id and chain.parent_id in by_id and chain.span_id not in seen:
            seen.add(chain.span_id)
            chain = by_id[chain.parent_id]
        assert chain is root or chain.parent_id == root_id, span.name

    turns = sorted((s for s in got if s.name.startswith("turn ")), key=lambda s: s.start_ns)
    assert [t.name for t in turns] == ["turn 1", "turn 2"]
    assert {t.service for t in turns} == {"cortex-worker"}
    chats = [s for s in got if s.name == f"chat {model}"]
    assert len(chats) == 2 and {by_id[c.parent_id].name for c in chats} == {"turn 1", "turn 2"}
    for chat in chats:  # the GenAI semantic conventions
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == model
        assert chat.attributes["gen_ai.usage.output_tokens"] > 0
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0

    calc = next(s for s in got if s.name == "tool calculator")
    assert calc.attributes["cortex.action.status"] == "ok"
    task = by_id[calc.parent_id]  # the cortex.action task in the tool worker's process...
    assert task.name == "cortex.action" and task.attributes["cortex.action.id"] == "sum"
    assert by_id[task.parent_id].name == "turn 1"  # ...under the turn that dispatched it
    assert any(s.name == "tool echo" for s in got)
