"""`GET /metrics`: counters kept by the job scripts, read from Redis at scrape time."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from cortex_worker.observability.metrics import BUCKETS
from cortex_worker.pools import NAMES as POOLS
from tests.harness import wait_until
from tests.integration.test_documents import action, run

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def api(workers: Any, api: Any) -> Any:
    return api


def scrape(api: Any) -> tuple[Samples, set[str]]:
    response = httpx.get(f"{api.url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families(response.text):
        families.add(f"{family.name}:{family.type}")
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def quiet_scrape(api: Any, timeout: float = 5.0) -> Samples:
    """A scrape once no job of the session is still running (other tests' jobs would move the
    counters too); after `timeout`, whatever there is."""
    deadline = time.monotonic() + timeout
    while True:
        samples, _ = scrape(api)
        if value(samples, "cortex_jobs_running") == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_metrics_move_by_what_a_document_did(api: Any) -> None:
    before = quiet_scrape(api)
    doc = (action("good", "echo", {"message": "fine"})
           + action("bad", "calculator", {"expression": "1/0"})
           + action("after_bad", "echo", {"message": "$bad"})
           + '<response final="true">done: $good</response>\n')
    _, events = run(api, doc)
    assert events[-1]["type"] == "job_failed", events[-1]
    after, families = scrape(api)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("cortex_jobs_ended_total", status="failed") == 1
    assert delta("cortex_jobs_ended_total", status="completed") == 0
    assert delta("cortex_actions_ended_total", type="tool", status="ok") == 1
    assert delta("cortex_actions_ended_total", type="tool", status="error") == 1
    assert delta("cortex_actions_ended_total", type="tool", status="skipped") == 1
    # both runs were queued and claimed once; the skipped one never ran
    assert delta("cortex_action_dispatch_seconds_count", type="tool") == 2
    assert delta("cortex_action_dispatch_seconds_bucket", type="tool", le="+Inf") == 2
    assert delta("cortex_action_dispatch_seconds_sum", type="tool") >= 0
    assert delta("cortex_action_duration_seconds_count", type="tool", status="ok") == 1
    assert delta("cortex_action_duration_seconds_count", type="tool", status="error") == 1
    assert delta("cortex_action_duration_seconds_count", type="tool", status="skipped") == 0
    assert value(after, "cortex_action_duration_seconds_sum", type="tool", status="ok") > 0
    # cumulative buckets, every bound present
    for labels in ({"type": "tool", "status": "ok"}, {"type": "tool", "status": "error"}):
        counts = [value(after, "cortex_action_duration_seconds_bucket", **labels,
                        le=floatToGoString(b)) for b in BUCKETS]
        assert counts == sorted(counts)
        assert counts[-1] <= value(after, "cortex_action_duration_seconds_count", **labels)

    assert {"cortex_jobs_ended:counter", "cortex_actions_ended:counter",
            "cortex_action_dispatch_seconds:histogram", "cortex_action_duration_seconds:histogram",
            "cortex_jobs:gauge", "cortex_jobs_running:gauge", "cortex_queue_length:gauge"} <= families
    for queue in POOLS:
        assert ("cortex_queue_length", (("queue", queue),)) in after
    assert value(after, "cortex_jobs", status="failed") >= 1
    assert value(after, "cortex_jobs", status="failed") - value(before, "cortex_jobs", status="failed") == 1


def test_cancelled_actions_are_counted(api: Any) -> None:
    before = quiet_scrape(api)
    doc = (action("slow", "sleep", {"seconds": 4})
           + action("later", "echo", {"message": "x"}, depends_on=["slow"]))
    response = httpx.post(f"{api.url}/v1/jobs", json={"protocol": doc}, timeout=30)
    job_id = response.json()["id"]
    wait_until(lambda: httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=5).json()["actions"][0]
               ["status"] == "running", timeout=15)
    assert httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", timeout=10).status_code == 200
    after, _ = scrape(api)
    assert value(after, "cortex_jobs_ended_total", status="cancelled") - \
        value(before, "cortex_jobs_ended_total", status="cancelled") == 1
    assert value(after, "cortex_actions_ended_total", type="tool", status="cancelled") - \
        value(before, "cortex_actions_ended_total", type="tool", status="cancelled") == 2

