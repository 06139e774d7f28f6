"""The text chunks of every turn this process generates, logged together.

A turn's thought and response chunks may wait up to `every_s` before they are logged. One
`emit` per stream per interval cost an agent worker as much CPU as reading the streams
(docs/performance.md): here one thread logs every turn's pending chunks in one Redis round
trip (a pipeline of `emit` scripts). A turn that must log at once (before it registers an
action, at a sync stop, at its end) calls `flush`, which writes its own pending events first:
events of one job are always logged in the order they were added. Each turn's events carry
its fence (recovery/fencing.py): those of a turn taken over are refused by the store, and
`on_stale` hears of it. With them goes the model's text they came from (`streamed`), where
the turn's model can continue a partial answer: the store keeps it as the turn's `partial`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from redis.exceptions import RedisError

from cortex_worker.store.state import Store

log = logging.getLogger(__name__)

Events = list[tuple[str, dict[str, Any]]]
Key = tuple[str, int | None]
"""A job and the fence of the turn that writes (None: not fenced)."""


class ChunkWriter:
    """Pending chunk events per job's turn, written by one daemon thread every `every_s`."""

    def __init__(self, store: Store, every_s: float,
                 prepare: Callable[[Events], Events] = list,
                 on_stale: Callable[[str, int | None], None] | None = None) -> None:
        self.store, self.every_s, self.prepare, self.on_stale = store, every_s, prepare, on_stale
        self._pending: dict[Key, Events] = {}
        self._streamed: dict[Key, list[str]] = {}
        self._lock = threading.Lock()  # guards _pending
        self._writing = threading.Lock()  # held while events are written: keeps each job's order
        self._thread: threading.Thread | None = None

    def add(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]],
            fence: int | None = None, streamed: str = "") -> None:
        """Log these events within `every_s`, after the job's earlier ones."""
        if not events and not streamed:
            return
        with self._lock:
            self._pending.setdefault((job_id, fence), []).extend(events)
            if streamed:
                self._streamed.setdefault((job_id, fence), []).append(streamed)
            if self._thread is None or not self._thread.is_alive():  # first use, or a fork
                self._thread = threading.Thread(target=self._run, name="cortex-chunks",
                                                daemon=True)
                self._thread.start()

    def flush(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]] = (),
              fence: int | None = None, streamed: str = "") -> None:
        """Log the job's pending events, then `events`, now (not after the job has ended;
        Fenced if the turn's `fence` is stale)."""
        with self._writing:
            with self._lock:
                batch = [*self._pending.pop((job_id, fence), []), *events]
                text = "".join(self._streamed.pop((job_id, fence), [])) + streamed
            if batch or text:
                self.store.emit(job_id, self.prepare(batch) if batch else [], live=True,
                                fence=fence, streamed=text)

    @contextmanager
    def taken(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]] = (),
              fence: int | None = None) -> Iterator[Events]:
        """The turn's pending events, then `events`, for the caller to log (as `flush` would)
        before the block ends, together with what else it writes: the turn's end (which
        drops the turn's partial answer, so its streamed text is dropped here)."""
        with self._writing:
            with self._lock:
                batch = [*self._pending.pop((job_id, fence), []), *events]
                self._streamed.pop((job_id, fence), None)
            yield self.prepare(batch) if batch else []

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            with self._writing:
                with self._lock:
                    batches, self._pending = self._pending, {}
                    streamed, self._streamed = self._streamed, {}
                if not batches and not streamed:
                    continue
                try:
                    stale = self.store.emit_many(
                        {key: self.prepare(events) for key, events in batches.items()},
                        live=True, streamed={key: "".join(t) for key, t in streamed.items()})
                except RedisError as exc:  # keep them, before anything added since
                    log.warning("text chunks of %d jobs not logged yet: Redis: %s",
                                len(batches), exc)
                    with self._lock:
                        for key, events in batches.items():
                            self._pending[key] = [*events, *self._pending.get(key, [])]
                        for key, text in streamed.items():
                            self._streamed[key] = [*text, *self._streamed.get(key, [])]
                    continue
                except Exception:  # never let a bug stop the writer
                    log.exception("text chunks of %d jobs could not be logged", len(batches))
                    continue
                for job, fence in stale:
                    if self.on_stale is not None:
                        self.on_stale(job, fence)
