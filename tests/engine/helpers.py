"""Helpers of the engine tests: documents to submit, and reading a job's event log."""

from __future__ import annotations

import json
from typing import Any

from cortex_worker.store import Store


def action(ident: str, name: str, params: dict[str, Any], mode: str = "async",
           **extra: Any) -> str:
    """A tool action of a protocol document."""
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="tool" mode="{mode}" id="{ident}">{json.dumps(body)}</action>\n'


def events(store: Store, job_id: str) -> list[dict[str, Any]]:
    """The job's whole event log, checked to be numbered 1, 2, 3 ... without a gap."""
    log = store.events_after(job_id)
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    return log


def of(log: list[dict[str, Any]], kind: str, action_id: str | None = None) -> list[dict[str, Any]]:
    return [e for e in log if e["type"] == kind
            and (action_id is None or e["data"].get("action_id") == action_id)]


def one(log: list[dict[str, Any]], kind: str, action_id: str | None = None) -> dict[str, Any]:
    found = of(log, kind, action_id)
    assert len(found) == 1, (kind, action_id, [(e["type"], e["data"].get("action_id"))
                                               for e in log])
    return found[0]["data"]


def status(store: Store, job_id: str) -> str:
    job = store.peek(job_id, "status")
    assert job is not None, f"no job {job_id}"
    return job.status
