"""A job's events on the client: the SSE decoder and the resume state. The typed `Event`
and the event types are the engine's own vocabulary (`cortex_worker.protocol.events`).

`EventStream` holds everything about following one job that does not depend on how bytes
are read, so `Client` and `AsyncClient` each only run its loop: connect with its headers,
feed it the lines, and ask it what to do when the connection drops.
"""

from __future__ import annotations

import time

from cortex_api.client.calls import job_path
from cortex_api.client.errors import ConnectionFailed, JobTimeout
from cortex_worker.protocol.events import Event


class SSEDecoder:
    """Server-sent events from lines: `data:` lines joined, comments and other fields skipped
    (Cortex's `id` is the event's `seq`). One per connection: a half-received event is lost
    with its connection, and sent again after the resume."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        """The event that a blank line completes, else None."""
        if not line:
            if not self._data:
                return None
            text, self._data = "\n".join(self._data), []
            return Event.model_validate_json(text)
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None


class EventStream:
    """Following one job across connections: what to ask for (`Last-Event-ID`), which events
    are new, when the job has ended, and how long to wait before reconnecting."""

    def __init__(self, job_id: str, after: int = 0, timeout: float | None = None, *,
                 retries: int = 5, backoff: float = 0.1, max_backoff: float = 5.0) -> None:
        self.path = f"{job_path(job_id)}/events"
        self.last = after
        self.done = False
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.failures = 0  # drops in a row without an event
        self._progressed = False

    def headers(self) -> dict[str, str]:
        """The headers of the next connection: resume after the last event seen."""
        return {"Last-Event-ID": str(self.last)} if self.last else {}

    def read_timeout(self, default: float) -> float:
        """How long a read of the next connection may wait: `default`, or less near the deadline."""
        self.check_deadline()
        if self.deadline is None:
            return default
        return max(0.01, min(default, self.deadline - time.monotonic()))

    def connected(self) -> SSEDecoder:
        """A connection is open: a fresh decoder for its lines."""
        self._progressed = False
        return SSEDecoder()

    def receive(self, decoder: SSEDecoder, line: str) -> Event | None:
        """The new event this line completes, if any; an event seen before is dropped."""
        self.check_deadline()
        event = decoder.feed(line)
        if event is None or event.seq <= self.last:
            return None
        self.last, self.failures, self._progressed = event.seq, 0, True
        self.done = event.terminal
        return event

    def closed(self) -> None:
        """The server ended the stream before the last event (it drops clients that fall
        behind): reconnect, unless that connection brought nothing (the log has no more)."""
        if not self._progressed:
            self.done = True

    def dropped(self, error: Exception) -> float:
        """The connection failed: seconds to wait before the next, or raise if it is hopeless."""
        self.check_deadline()
        self.failures += 1
        if self.failures > self.retries:
            raise ConnectionFailed(f"the event stream {self.path} failed {self.failures} times "
                                   f"in a row (after seq {self.last}): {error}") from error
        return min(self.max_backoff, self.backoff * 2 ** (self.failures - 1))

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise JobTimeout(f"{self.path}: the job did not end within {self.timeout:g} s "
                             f"(last event seen: seq {self.last})")
