"""Tracing is off unless an OTLP endpoint is set (`cortex_worker.observability.tracing`)."""

from __future__ import annotations

import pytest

from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.sse import hand_over
from cortex_worker.llm.stream import TextDelta
from cortex_worker.observability import tracing

pytestmark = pytest.mark.unit


def test_without_an_endpoint_nothing_is_set_up_and_nothing_wraps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing._here, "pid", None)
    assert tracing.configure("cortex-test") is False and not tracing.enabled()
    pieces = iter([TextDelta("x")])
    take = hand_over
    assert tracing.model_stream(ModelConfig(model="m"), lambda given: given is take and pieces,
                                take) is pieces  # the stream itself, its take unwrapped
    with tracing.span("turn 1", "job") as current:
        assert current is None
    tracing.record_job("job", None, "completed", {})  # a no-op, not an error


def test_a_jobs_trace_ids_are_the_same_everywhere_and_valid() -> None:
    trace_id, span_id = tracing.job_ids("0123abcd")
    assert (trace_id, span_id) == tracing.job_ids("0123abcd")
    assert 0 < trace_id < 2 ** 128 and 0 < span_id < 2 ** 64
    assert tracing.job_ids("other")[0] != trace_id
