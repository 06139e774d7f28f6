"""Fencing: a paused holder that wakes up changes nothing, and stops.

Every lease carries a number that only grows: a turn's `turn_fence` (taken by each grant in
`resume`) and an action's attempt (taken by `claim`). The holder passes it with each write,
and the store's script refuses a write whose number is no longer current, in the same call
(lua/prelude.lua: stale_turn, stale_attempt), counting it (metric `cortex_stale_writes`). A
refused write raises `Fenced` in the holder; this module is how the holder's process learns
it and stops its work: the turn's stream closes (`turn_lost`, read by the turn's reader), and a
stale action attempt's sandboxed processes are killed (`Holding`, checked by the heartbeat).
A status check between writes cannot do this: a process that was paused does not know it was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cortex_worker.recovery.owners import owner
from cortex_worker.store.state import Fenced, Store

log = logging.getLogger(__name__)

_lock = threading.Lock()
_lost_turns: set[tuple[str, int | None]] = set()


def refused(exc: Fenced) -> None:
    """Log a write the store refused (the metric is counted by the store's script)."""
    log.warning("stale write dropped: %s (its lease was taken over while this process was "
                "paused or cut off)", exc)


def turn_lost(job_id: str, fence: int | None) -> None:
    """A write of the job's turn with `fence` was refused: that turn is another's now."""
    if fence is None:
        return
    with _lock:
        _lost_turns.add((job_id, fence))
    log.warning("job %s: turn fence %s is stale (the turn was taken over): its writes are "
                "dropped and its stream closes", job_id, fence)


def is_lost(job_id: str, fence: int | None) -> bool:
    """Whether a write of this turn was refused (it must stop)."""
    return fence is not None and (job_id, fence) in _lost_turns


@contextmanager
def turn(job_id: str, fence: int | None) -> Iterator[None]:
    """The current thread generates the job's turn of `fence`; what was learnt of it (a
    refused write) is dropped when it stops."""
    try:
        yield
    finally:
        with _lock:
            _lost_turns.discard((job_id, fence))


@dataclass(eq=False)
class Holding:
    """One action attempt this process runs, and how to stop it if it turns out stale."""

    job_id: str
    action_id: str
    attempt: int
    stops: list[Callable[[], None]] = field(default_factory=list)
    stale: bool = False

    def on_stale(self, stop: Callable[[], None]) -> None:
        """Run `stop` (once) if this attempt is found stale; at once if it was already."""
        with _lock:
            if not self.stale:
                self.stops.append(stop)
                return
        stop()


_held: dict[int, Holding] = {}  # by the running thread's ident
_local = threading.local()


@contextmanager
def holding(job_id: str, action_id: str, attempt: int) -> Iterator[Holding]:
    """The current thread runs this attempt: `check` stops it if it becomes stale."""
    held = Holding(job_id, action_id, attempt)
    ident = threading.get_ident()
    with _lock:
        _held[ident] = held
    _local.held = held
    try:
        yield held
    finally:
        _local.held = None
        with _lock:
            _held.pop(ident, None)


def current() -> Holding | None:
    """The attempt the current thread runs, if any (a sandbox registers its stop here)."""
    return getattr(_local, "held", None)


def check(store: Store) -> int:
    """Stop every attempt this process runs whose lease was taken over (another attempt was
    claimed) or whose job failed or was cancelled; returns how many. Run after each beat."""
    with _lock:
        held = list(_held.values())
    if not held:
        return 0
    attempts = store.current_attempts([(h.job_id, h.action_id) for h in held], owner())
    stale = [h for h, now in zip(held, attempts, strict=True) if now != h.attempt]
    for h in stale:
        with _lock:
            if h.stale:
                continue
            h.stale, stops = True, list(h.stops)
        log.warning("job %s: attempt %d of action %s is stale (re-run elsewhere, or its job "
                    "ended): stopping it", h.job_id, h.attempt, h.action_id)
        for stop in stops:
            try:
                stop()
            except Exception:  # never let a stop stop the heartbeat
                log.exception("stopping a stale attempt failed")
    return len(stale)
