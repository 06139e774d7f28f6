"""Waiting in place: a turn whose actions run holds its thread a while (`turn_wait_s`, in at
most half of an agent worker's threads), so the drain is published to this process and the
next turn starts without a trip through the queue."""

from __future__ import annotations

import threading
import time

from cortex_worker.jobs.ends import Watch
from cortex_worker.recovery.owners import owner
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Store

WAIT_SLICE_S = 0.5  # a waiting turn looks this often whether its worker is shutting down



class _Slots:
    """This process's wait slots (None: its turns never wait) and whether it is stopping."""

    def __init__(self) -> None:
        self.semaphore: threading.Semaphore | None = None
        self.shutting_down = threading.Event()


_SLOTS = _Slots()


def wait_in_place(threads: int) -> None:
    """Let up to half of this agent worker's `threads` hold a turn that waits for its actions
    (called as a threaded worker starts: a turn run inline, by the stub broker or eagerly, or
    in a one-thread process, never waits)."""
    _SLOTS.semaphore = threading.Semaphore(threads // 2) if threads >= 2 else None
    _SLOTS.shutting_down.clear()


def stop_waiting() -> None:
    """The worker is shutting down: waiting turns stop waiting within WAIT_SLICE_S."""
    _SLOTS.shutting_down.set()


class WaitSlot:
    """A turn's claim on one of the process's wait slots, taken as the turn ends (so the
    slots count turns that wait, not turns that stream) and given back when it left."""

    def __init__(self) -> None:
        self.waiter = ""  # this process's owner name while the slot is held
        self._held: threading.Semaphore | None = None

    def take(self) -> str:
        """This process's owner name if the turn may wait in place for its actions, else ''."""
        slots = _SLOTS.semaphore
        if (self._held is None and slots is not None and not _SLOTS.shutting_down.is_set()
                and get_settings().turn_wait_s > 0 and slots.acquire(blocking=False)):
            self._held, self.waiter = slots, owner()
        return self.waiter

    def __enter__(self) -> WaitSlot:
        return self

    def __exit__(self, *_: object) -> None:
        if self._held is not None:
            self._held.release()
            self._held, self.waiter = None, ""


def waited(store: Store, job_id: str, pushed: Watch, waiter: str) -> bool:
    """Wait for the job's drain to be pushed here; True if this thread takes the next turn."""
    deadline = time.monotonic() + get_settings().turn_wait_s
    while not _SLOTS.shutting_down.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if pushed.drained.wait(min(left, WAIT_SLICE_S)):
            return True  # drained (or ended: `resume` then finds no turn due)
    return store.unwait(job_id, waiter)


