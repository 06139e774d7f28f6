"""Helpers of the engine tests: documents to submit, reading a job's event log, and counting
Redis round trips."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex_worker.store.state import Store


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


class RoundTrips:
    """Counts the Redis round trips (connections taken from the store's pool) from the last
    call of one method to calls of another."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.monkeypatch = monkeypatch
        pool = store.redis.connection_pool
        taken = pool.get_connection

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return taken(*args, **kwargs)

        monkeypatch.setattr(pool, "get_connection", counted)

    def start_at(self, owner: object, name: str) -> None:
        """Count from zero at each call of `owner.name`."""
        real = getattr(owner, name)

        def started(*args: Any, **kwargs: Any) -> Any:
            self.count = 0
            return real(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, started)

    def seen_at(self, owner: object, name: str, *, after: bool = False) -> list[int]:
        """The counts at each call of `owner.name` (before it runs, or `after`)."""
        real, seen = getattr(owner, name), []

        def noted(*args: Any, **kwargs: Any) -> Any:
            if not after:
                seen.append(self.count)
            out = real(*args, **kwargs)
            if after:
                seen.append(self.count)
            return out

        self.monkeypatch.setattr(owner, name, noted)
        return seen
