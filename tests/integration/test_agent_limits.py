"""Agent jobs stop promptly when cancelled, or when their wall time runs out, mid-generation."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.fake_llm import FakeLLM, Turn
from tests.integration.test_agents import (
    api,  # noqa: F401  (fixture)
    finish,
    llm,  # noqa: F401  (fixture)
    start,
    unique,
)


def long_thought(seconds: float, rate: float = 40) -> Turn:
    words = "thinking about it some more " * int(seconds * rate * 4 / 28 + 1)
    return Turn(text=f"<thought>{words}</thought>", tokens_per_second=rate)


def test_cancel_stops_the_generation(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("cancel")
    llm.script(model, [long_thought(8)])
    job_id = start(api, "tester", "go", model=model)
    httpx_deadline = time.monotonic() + 10
    while not llm.stream_log(model) and time.monotonic() < httpx_deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    cancelled_at = time.monotonic()
    assert httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel").status_code == 200
    events = finish(api, job_id, timeout=15)
    assert events[-1]["type"] == "job_cancelled"
    # the coordinator noticed within its status-check period and hung up on the model
    deadline = time.monotonic() + 5
    while llm.outcomes(model)[-1] == "streaming" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.outcomes(model)[-1] == "client_disconnected"
    assert time.monotonic() - cancelled_at < 5


def test_a_generation_past_the_wall_time_fails_the_job(api: Any, llm: FakeLLM) -> None:  # noqa: F811
    model = unique("slow")
    llm.script(model, [long_thought(10)])
    started = time.monotonic()
    job_id = start(api, "hasty", "go", model=model)  # max_wall_time_s: 2
    events = finish(api, job_id, timeout=20)
    assert events[-1]["type"] == "job_failed"
    assert "wall time limit (2 s)" in events[-1]["data"]["error"]
    assert time.monotonic() - started < 8
