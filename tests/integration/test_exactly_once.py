"""At-least-once delivery, exactly-once results: a redelivered task does not run again."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests import harness
from tests.integration.test_documents import action, of, run


def test_redelivered_action_is_not_run_again(workers: Any, api: Any, cortex_env: dict[str, str]) -> None:
    doc = action("once", "echo", {"message": "hi"}) + action("next", "echo", {"message": "$once"})
    job_id, events = run(api, doc)
    assert events[-1]["type"] == "job_completed"
    spec = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()["actions"][0]
    assert spec["id"] == "once" and spec["attempts"] == 1

    # Deliver the finished action's task again, as the broker does after a worker dies.
    app = harness.celery_control_app(cortex_env)
    full = {"id": "once", "type": "tool", "mode": "async", "name": "echo",
            "parameters": {"message": "hi"}, "output_key": None, "depends_on": [], "after": [],
            "timeout": None, "retry": 0, "on_error": "fail", "in_thought": False}
    def processed() -> dict[str, int]:  # tasks the tool pool ran, by name
        totals: dict[str, int] = {}
        for stats in (app.control.inspect(timeout=2).stats() or {}).values():
            for name, count in stats.get("total", {}).items():
                totals[name] = totals.get(name, 0) + count
        return totals

    before = processed()
    app.send_task("cortex.action", args=[job_id, "once", full, True], queue="tool")
    app.send_task("cortex.action", args=[job_id, "once"], queue="tool")  # as a canvas step
    # as a canvas step sent by an earlier version, under the task name it had then
    app.send_task("cortex.action.canvas", args=[job_id, "once"], queue="tool")
    sent = {"cortex.action": 2, "cortex.action.canvas": 1}
    harness.wait_until(lambda: all(
        processed().get(name, 0) >= before.get(name, 0) + count
        for name, count in sent.items()), timeout=20)
    time.sleep(0.5)  # accepted; a re-run would log action_started within milliseconds
    later = httpx.get(f"{api.url}/v1/jobs/{job_id}/events?after=0", timeout=20).text
    assert later.count("event: action_started") == 2  # once and next, never again
    job = httpx.get(f"{api.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "completed"
    assert [a["attempts"] for a in job["actions"]] == [1, 1]
    assert len(of(events, "action_completed")) == 2


def test_cortex_exec_follows_a_document(workers: Any, api: Any, cortex_env: dict[str, str],
                                        tmp_path: Any) -> None:
    import subprocess

    path = tmp_path / "doc.xml"
    path.write_text(action("a", "sleep", {"seconds": 0.2}) + action("b", "sleep", {"seconds": 0.2})
                    + "<response>done: $a</response>")
    out = subprocess.run([*harness.cortex_command(), "exec", str(path), "--url", api.url],
                         env={**cortex_env, "COLUMNS": "120"}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job_completed" in out.stdout
    assert 'done: {"slept": 0.2}' in out.stdout
    assert "parallel speedup" in out.stdout and "2 actions" in out.stdout
