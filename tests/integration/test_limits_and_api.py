"""Per-job limits, listing and validation endpoints, readiness, and SSE fan-out at scale."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from cortex_api.cli import app as cli
from cortex_api.server import raise_open_files_limit
from cortex_worker import handles
from tests.integration.test_documents import action, one, run
from tests.manifest_helpers import CORPUS


def test_parallelism_limit_per_job(workers: Any, api: Any) -> None:
    doc = "".join(action(f"s{i}", "sleep", {"seconds": 0.2}) for i in range(6))
    _, events = run(api, doc, max_parallel=2)
    assert events[-1]["type"] == "job_completed"
    running, peak = 0, 0
    for event in events:
        if event["type"] == "action_started":
            running += 1
            peak = max(peak, running)
        elif event["type"] in ("action_completed", "action_failed"):
            running -= 1
    assert peak == 2


def test_output_past_the_cap_is_stored_truncated(workers: Any, api: Any) -> None:
    doc = action("big", "python", {"code": "print('x' * 400_000)"})
    job_id, events = run(api, doc)
    done = one(events, "action_completed", "big")["data"]
    assert done["truncated"] is True
    assert "[truncated:" in done["result"]
    assert len(done["result"].encode()) < 300 * 1024
    stored = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()["actions"][0]
    assert "[truncated:" in json.dumps(stored)


def test_job_listing_filters_by_status(workers: Any, api: Any) -> None:
    ok_id, _ = run(api, action("e", "echo", {"message": 1}))
    bad_id, _ = run(api, action("f", "fail", {"message": "x"}))
    completed = httpx.get(f"{api.url}/v1/jobs", params={"status": "completed"}).json()["items"]
    failed = httpx.get(f"{api.url}/v1/jobs", params={"status": "failed"}).json()["items"]
    assert ok_id in {j["id"] for j in completed} and ok_id not in {j["id"] for j in failed}
    assert bad_id in {j["id"] for j in failed} and bad_id not in {j["id"] for j in completed}
    assert httpx.get(f"{api.url}/v1/jobs", params={"status": "bogus"}).status_code == 422


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.xml"))[:3], ids=lambda p: p.stem)
def test_validate_endpoint_matches_the_cli(api: Any, path: Path, cortex_env: dict[str, str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both check targets against the same settings, as submitting the document would."""
    for key, value in cortex_env.items():  # the API's manifests and document model
        if key.startswith("CORTEX_"):
            monkeypatch.setenv(key, value)
    handles.reset()
    served = httpx.post(f"{api.url}/v1/validate", json={"protocol": path.read_text()}).json()
    printed = json.loads(CliRunner().invoke(cli, ["validate", "--json", str(path)]).stdout)
    monkeypatch.undo()
    handles.reset()
    assert served == printed


def test_validate_endpoint_reports_what_submitting_rejects(api: Any) -> None:
    doc = action("a", "no_such_tool", {})
    served = httpx.post(f"{api.url}/v1/validate", json={"protocol": doc}).json()
    rejected = httpx.post(f"{api.url}/v1/jobs", json={"protocol": doc})
    assert rejected.status_code == 422
    assert [e["kind"] for e in served["errors"]] == ["unknown_tool"]
    assert served["errors"][0]["message"] in rejected.text


def test_readyz_reports_pools(workers: Any, api: Any) -> None:
    response = httpx.get(f"{api.url}/readyz", timeout=10)
    assert response.status_code == 200, response.text
    assert "tool" in response.text and "agent" in response.text


def test_many_sse_clients_share_one_redis_connection(workers: Any, api: Any,
                                                     redis_client: Any) -> None:
    doc = action("wait", "sleep", {"seconds": 1.5}) + action("e", "echo", {"message": "$wait"})
    job_id = httpx.post(f"{api.url}/v1/jobs", json={"protocol": doc}).json()["id"]
    clients = 1000  # the figure; `cortex api` lifts its open-files limit for them
    assert raise_open_files_limit() > clients + 100  # and so does this client process

    async def listen(client: httpx.AsyncClient) -> list[int]:
        seqs: list[int] = []
        async with client.stream("GET", f"{api.url}/v1/jobs/{job_id}/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("id:"):
                    seqs.append(int(line[3:]))
        return seqs

    baseline = len(redis_client.client_list())

    async def main() -> tuple[list[list[int]], int]:
        limits = httpx.Limits(max_connections=clients + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            tasks = [asyncio.create_task(listen(client)) for _ in range(clients)]
            await asyncio.sleep(1.0)  # all connected while the job still runs
            connections = len(redis_client.client_list())
            return await asyncio.gather(*tasks), connections

    results, connections = asyncio.run(main())
    assert all(seqs == results[0] for seqs in results)
    assert results[0] == list(range(1, len(results[0]) + 1))
    # 1,000 clients share the API's one subscription and its small replay pool.
    assert connections - baseline < 10, (baseline, connections)
    final = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()
    assert final["status"] == "completed"
