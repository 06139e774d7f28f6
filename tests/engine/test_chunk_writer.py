"""Text chunks of every turn in a process, logged together (`cortex_worker.store.chunk_writer`)."""

from __future__ import annotations

import time

from cortex_worker.jobs.lifecycle import cancel_job
from cortex_worker.store.chunk_writer import ChunkWriter
from cortex_worker.store.state import Store
from tests.engine.helpers import events


def chunk(text: str) -> tuple[str, dict[str, str]]:
    return ("thought_chunk", {"text": text})


def texts(store: Store, job_id: str) -> list[str]:
    return [e["data"]["text"] for e in events(store, job_id) if e["type"] == "thought_chunk"]


def test_pending_chunks_of_many_jobs_are_logged_within_the_interval(store: Store) -> None:
    writer = ChunkWriter(store, 0.05)
    jobs = [f"cw-{n}" for n in range(20)]
    for job_id in jobs:
        store.create_job(job_id, {"kind": "agent", "status": "running"}, 600)
        writer.add(job_id, [chunk("a"), chunk("b")])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(texts(store, j) != ["a", "b"] for j in jobs):
        time.sleep(0.02)
    assert all(texts(store, j) == ["a", "b"] for j in jobs)


def test_a_flush_logs_the_jobs_pending_chunks_first_and_nothing_after_its_end(
        store: Store) -> None:
    writer = ChunkWriter(store, 3600.0)  # the thread never writes: only `flush` does
    store.create_job("cw-order", {"kind": "agent", "status": "running"}, 600)
    writer.add("cw-order", [chunk("1"), chunk("2")])
    writer.flush("cw-order", [chunk("3")])
    assert texts(store, "cw-order") == ["1", "2", "3"]

    writer.add("cw-order", [chunk("late")])
    cancel_job(store, "cw-order")
    writer.flush("cw-order")
    log = events(store, "cw-order")
    assert texts(store, "cw-order") == ["1", "2", "3"] and log[-1]["type"] == "job_cancelled"
