"""Server-sent events of a job's log: one shared pub/sub connection, replay, dedupe, resume.

`EventHub` holds ONE async pub/sub connection for the whole process: it SUBSCRIBEs to a job's
channel when the first client of that job arrives and UNSUBSCRIBEs when the last one leaves,
fanning each event out to per-client bounded queues. Replays read the job's stream (XRANGE)
through a small shared connection pool. `event_stream` is one client's stream: subscribe first,
replay after the resume point, then live events, never one twice and never with a hole.
Each event is written as one SSE message (`format_event`), or as its AG-UI events
(`agui_encoder`, see `cortex_api.agui`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from cortex_api.agui import AgUiTranslator
from cortex_api.errors import REDIS_ERRORS
from cortex_worker.protocol.events import JOB_TERMINAL, TERMINAL_EVENTS
from cortex_worker.store.connect import (
    SUBSCRIBER_PROTOCOL,
    Silence,
    async_client,
    check_writable,
)
from cortex_worker.store.keys import channel, job_keys
from cortex_worker.store.state import dumps

log = logging.getLogger("cortex.api.sse")

HEARTBEAT_S = 15.0
PAGE_SIZE = 500
QUEUE_SIZE = 1000
ON_MASTER_MAX = 10_000
"""How many jobs a hub remembers to read from the master (its replica did not have them)."""
SEND_TIMEOUT_S = 30.0
#: Pauses of a stream between Redis errors before it gives up (about 30 s in all).
REDIS_PAUSES_S = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0)
#: Times a hub command is sent again on a new connection before its error reaches the stream.
HUB_RETRIES = 3
#: `?format=` values of a job's event stream: Cortex's own events, or AG-UI events.
STREAM_FORMATS = ("cortex", "ag-ui")

Event = dict[str, Any]
"""An event as the log holds it (`protocol.events.Event`'s fields): passed through unparsed."""


# -- wire format (pure) -------------------------------------------------------------------
def sse_message(data: str, *, event: str | None = None, id: int | str | None = None) -> str:
    """One SSE message; a multi-line `data` becomes several `data:` lines."""
    lines = [] if id is None else [f"id: {id}"]
    if event:
        lines.append(f"event: {event}")
    lines += [f"data: {line}" for line in (data.splitlines() or [""])]
    return "\n".join(lines) + "\n\n"


def format_event(event: Event) -> str:
    """`id: <seq>`, `event: <type>`, `data: <event JSON>`."""
    return sse_message(dumps(event), event=str(event["type"]), id=int(event["seq"]))


def sse_comment(text: str) -> str:
    """A comment line: ignored by clients, keeps proxies from closing an idle stream."""
    return "".join(f": {line}\n" for line in (text.splitlines() or [""])) + "\n"


def is_terminal(event: Event) -> bool:
    """Whether this is a job's last event."""
    return event.get("type") in TERMINAL_EVENTS


def resume_point(last_event_id: str | None, after: int = 0) -> int:
    """Where a client resumes: `Last-Event-ID` if sent, else `?after=`."""
    if last_event_id is None or not last_event_id.strip():
        return after
    try:
        seq = int(last_event_id.strip())
    except ValueError:
        seq = -1
    if seq < 0:
        raise ValueError(f"Last-Event-ID must be an event seq (an integer >= 0), "
                         f"not {last_event_id!r}")
    return seq


@dataclass(slots=True)
class Cursor:
    """The last seq sent to one client; decides what a new event means for it."""

    last: int = 0

    def classify(self, seq: int) -> Literal["old", "next", "gap"]:
        """`old`: already sent; `next`: send it; `gap`: events between are missing."""
        if seq <= self.last:
            return "old"
        return "next" if seq == self.last + 1 else "gap"

    def admit(self, event: Event) -> bool:
        """Advance past `event` if it is new; False for a duplicate."""
        seq = int(event["seq"])
        if seq <= self.last:
            return False
        self.last = seq
        return True


# -- fan-out (in memory) ------------------------------------------------------------------
class Listener:
    """One client's inbox: live events, or None meaning "catch up from the log"."""

    def __init__(self, maxsize: int = QUEUE_SIZE) -> None:
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize)
        self.overflowed = False

    def offer(self, item: Event | None) -> bool:
        """Queue `item`; a full queue marks the client as too slow (it will be disconnected)."""
        if self.overflowed:
            return False
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True
            return False
        return True

    async def get(self) -> Event | None:
        return await self.queue.get()


class Fanout:
    """Listeners per channel. `add`/`remove` say when a channel gains its first / loses its last."""

    def __init__(self) -> None:
        self._listeners: dict[str, set[Listener]] = {}

    def add(self, name: str, listener: Listener) -> bool:
        """Register `listener`; True if the channel had no entry (subscribe now)."""
        first = name not in self._listeners
        self._listeners.setdefault(name, set()).add(listener)
        return first

    def remove(self, name: str, listener: Listener) -> bool:
        """Unregister `listener`; True if the channel is now unused (unsubscribe now)."""
        listeners = self._listeners.get(name)
        if listeners is None:
            return False
        listeners.discard(listener)
        if listeners:
            return False
        del self._listeners[name]
        return True

    def publish(self, name: str, event: Event) -> int:
        """Offer `event` to the channel's listeners; overflowed ones are dropped. Returns deliveries."""
        listeners = self._listeners.get(name)
        if not listeners:
            return 0
        delivered = 0
        for listener in list(listeners):
            if listener.offer(event):
                delivered += 1
            else:  # too slow: it gets nothing more; its stream ends when it next runs
                listeners.discard(listener)
        return delivered

    def resync(self) -> None:
        """Tell every listener to catch up from the log (live messages may have been lost)."""
        for listeners in self._listeners.values():
            for listener in list(listeners):
                if not listener.offer(None):
                    listeners.discard(listener)

    def channels(self) -> list[str]:
        return list(self._listeners)

    def __len__(self) -> int:
        return sum(len(v) for v in self._listeners.values())


# -- one client's stream ------------------------------------------------------------------
class EventSource(Protocol):
    """What a stream needs: live events of a job, pages of its log, and its status."""

    def listen(self, job_id: str) -> AbstractAsyncContextManager[Listener]: ...

    async def read(self, job_id: str, after: int, count: int) -> list[Event]: ...

    async def status(self, job_id: str) -> str | None: ...


async def catch_up(source: EventSource, job_id: str, cursor: Cursor,
                   page: int = PAGE_SIZE) -> AsyncIterator[Event]:
    """Events of the log after `cursor`, page by page, advancing it."""
    while True:
        events = await source.read(job_id, cursor.last, page)
        before = cursor.last
        for event in events:
            if cursor.admit(event):
                yield event
        if len(events) < page or cursor.last == before:
            return


async def event_stream(source: EventSource, job_id: str, after: int = 0, *,
                       encode: Callable[[Event], str] = format_event,
                       heartbeat_s: float = HEARTBEAT_S, page: int = PAGE_SIZE) -> AsyncIterator[str]:
    """SSE text of a job's events after seq `after`, each written by `encode` (in seq order,
    once; "" writes nothing); ends after the job's last event."""
    async with aclosing(job_events(source, job_id, after, heartbeat_s, page)) as items:
        async for item in items:
            text = sse_comment(item) if isinstance(item, str) else encode(item)
            if text:
                yield text


async def job_events(source: EventSource, job_id: str, after: int = 0,
                     heartbeat_s: float = HEARTBEAT_S,
                     page: int = PAGE_SIZE) -> AsyncIterator[Event | str]:
    """The events after seq `after`, and comments (str) for the client; ends after the last.
    The one way every protocol follows a job (SSE, AG-UI, MCP progress, A2A updates).

    A Redis error (a lost connection, or no free connection in the replay pool while the API
    is overloaded) does not cut the stream: it starts again where it stopped, after a pause
    the client is told of, as a reconnecting client would. It ends only after `REDIS_PAUSES_S`
    has run out with no event sent in between; the client then resumes with Last-Event-ID."""
    cursor = Cursor(after)
    pauses = iter(REDIS_PAUSES_S)
    while True:
        sent = cursor.last
        try:  # closed with `job_events`, so that its listener leaves the hub at once
            async with aclosing(_follow(source, job_id, cursor, heartbeat_s, page)) as items:
                async for item in items:
                    yield item
            return
        except REDIS_ERRORS as exc:
            error = exc
        if cursor.last != sent:  # it got on between errors: a new outage, a fresh budget
            pauses = iter(REDIS_PAUSES_S)
        pause = next(pauses, None)
        log.warning("event stream of %s: Redis failed after seq %d (%s); %s", job_id,
                    cursor.last, error, "giving up" if pause is None else f"again in {pause}s")
        if pause is None:
            yield f"Redis is unavailable ({error}): reconnect with Last-Event-ID"
            return
        yield f"Redis is unavailable ({error}): reading again in {pause}s"
        await asyncio.sleep(pause)


async def _follow(source: EventSource, job_id: str, cursor: Cursor, heartbeat_s: float,
                  page: int) -> AsyncIterator[Event | str]:
    """`job_events` between two Redis errors: subscribe, replay after `cursor`, then live."""
    async with source.listen(job_id) as listener:  # subscribed before the replay reads the log
        async for event in catch_up(source, job_id, cursor, page):
            yield event
            if is_terminal(event):
                return
        if await _ended(source, job_id):
            async for event in catch_up(source, job_id, cursor, page):
                yield event
            return
        while True:
            if listener.overflowed:
                yield "too slow: disconnected; reconnect with Last-Event-ID"
                return
            try:
                item = await asyncio.wait_for(listener.get(), heartbeat_s)
                idle = False
            except TimeoutError:
                item, idle = None, True
            if item is not None and cursor.classify(int(item["seq"])) != "gap":
                if cursor.admit(item):
                    yield item
                    if is_terminal(item):
                        return
                continue
            # a hole before a live event, a lost connection, or a quiet spell: read the log
            async for event in catch_up(source, job_id, cursor, page):
                yield event
                if is_terminal(event):
                    return
            if item is not None and cursor.admit(item):  # not in the log (trimmed): send it
                yield item
                if is_terminal(item):
                    return
            if idle:
                if await _ended(source, job_id):
                    async for event in catch_up(source, job_id, cursor, page):
                        yield event
                    return
                yield "keep-alive"


async def history(source: EventSource, job_id: str, last: int,
                  page: int = PAGE_SIZE) -> AsyncIterator[Event]:
    """The log's events with seq <= `last`: what a client resuming after `last` has seen."""
    seen = 0
    while seen < last:
        events = await source.read(job_id, seen, min(page, last - seen))
        if not events:
            return
        for event in events:
            yield event
        seen = int(events[-1]["seq"])


async def agui_encoder(source: EventSource, job_id: str, after: int, *,
                       thread_id: str | None = None) -> Callable[[Event], str]:
    """`encode` for `?format=ag-ui`: each event's AG-UI events, all with its seq as `id` and
    no `event:` field (EventSource's `onmessage` only sees unnamed messages). Its translator
    has first read the log up to `after`, so a resumed stream goes on exactly where the
    interrupted one stopped."""
    translate = AgUiTranslator(job_id, thread_id)
    async for event in history(source, job_id, after):
        translate(event)

    def encode(event: Event) -> str:
        return "".join(sse_message(dumps(item), id=int(event["seq"]))
                       for item in translate(event))

    return encode


async def _ended(source: EventSource, job_id: str) -> bool:
    status = await source.status(job_id)
    return status is None or status in JOB_TERMINAL


class EventStreamResponse(StreamingResponse):
    """`text/event-stream`; a client that cannot take a message within `send_timeout` is dropped."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], *, send_timeout: float = SEND_TIMEOUT_S) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.send_timeout = send_timeout

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            with anyio.fail_after(self.send_timeout):
                await send(message)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            log.info("dropping an SSE client that stopped reading for %ss", self.send_timeout)
        finally:  # end the generator now, so its listener leaves the hub at once
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


# -- the hub ------------------------------------------------------------------------------
class EventHub:
    """One pub/sub connection for every SSE client, and a small pool for replays."""

    def __init__(self, client: aioredis.Redis, pubsub_client: aioredis.Redis, *,
                 queue_size: int = QUEUE_SIZE, subscribe_timeout: float = 2.0,
                 poll_s: float = 5.0, master: aioredis.Redis | None = None) -> None:
        self.redis = client
        self._master = master  # readiness asks it whether writes are taken (else `client`)
        self._on_master: dict[str, None] = {}  # jobs the replica did not have: read the master
        self._pubsub_client = pubsub_client
        self._pubsub = pubsub_client.pubsub()
        self._fanout = Fanout()
        self._confirmed: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self.queue_size = queue_size
        self.subscribe_timeout = subscribe_timeout
        self.poll_s = poll_s

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 4, **kwargs: Any) -> EventHub:
        """A hub on `url` (plain or Sentinel: see cortex_worker.store.connect): replays share
        at most `max_connections` connections (a busy pool is waited for, up to 30 s: under
        load that is better than a 503). A command is tried again a few times on a new
        connection (to the new master after a failover); `event_stream` rides out longer
        outages itself.

        Behind Sentinel the hub reads and follows a replica (the master when it has none):
        the master's PUBLISH reaches a replica's subscribers through replication, with the
        write it announces, so a client is only ever sent events a replica has, and the
        replica promoted in a failover has every one of them (a seq a client saw is never
        given to other content). A job the replica does not have (yet) is read from the
        master (`_job_fields`)."""
        def retry() -> AsyncRetry:
            return AsyncRetry(ExponentialBackoff(cap=1.0, base=0.05), HUB_RETRIES)

        replays = async_client(url, retry=retry(), max_connections=max_connections,
                               pool_timeout=30, replica=True)
        following = async_client(url, retry=retry(), replica=True,
                                 protocol=SUBSCRIBER_PROTOCOL)
        master = async_client(url, retry=retry(), max_connections=max_connections,
                              pool_timeout=30)
        return cls(replays, following, master=master, **kwargs)

    # -- EventSource --------------------------------------------------------------------
    @asynccontextmanager
    async def listen(self, job_id: str) -> AsyncIterator[Listener]:
        """Receive a job's live events while inside; subscribed (and confirmed) on entry."""
        name = channel(job_id)
        listener = Listener(self.queue_size)
        async with self._lock:
            if self._fanout.add(name, listener):
                self._confirmed[name] = asyncio.Event()
                try:
                    await self._pubsub.subscribe(name)
                except BaseException:
                    self._fanout.remove(name, listener)
                    self._confirmed.pop(name, None)
                    raise
                self._start_reader()
            confirmed = self._confirmed[name]
        try:
            with contextlib.suppress(TimeoutError):  # if late, gap checks and idle catch-ups cover it
                await asyncio.wait_for(confirmed.wait(), self.subscribe_timeout)
            yield listener
        finally:
            with anyio.CancelScope(shield=True):  # the client's task is being cancelled
                await self._leave(name, listener)

    async def read(self, job_id: str, after: int, count: int) -> list[Event]:
        """Up to `count` events with seq > `after` (XRANGE on the job's stream)."""
        entries = await self._node(job_id).xrange(job_keys(job_id).events,
                                                  min=f"{after + 1}-0", count=count)
        return [json.loads(fields["e"]) for _, fields in entries]

    async def status(self, job_id: str) -> str | None:
        """The job's status, None if there is no such job."""
        return (await self._job_fields(job_id, "status"))[0]

    async def status_and_tenant(self, job_id: str) -> tuple[str | None, str | None]:
        """The job's status and tenant (None, None if there is no such job)."""
        status, tenant = await self._job_fields(job_id, "status", "tenant")
        return status, tenant

    async def session(self, job_id: str) -> str | None:
        """The session the job answers a message of, if any (AG-UI's thread)."""
        return (await self._job_fields(job_id, "status", "session"))[1] or None

    def _node(self, job_id: str) -> aioredis.Redis:
        """Where the job is read: the replica, or the master once the replica was found
        without it."""
        return self._master if self._master is not None and job_id in self._on_master \
            else self.redis

    async def _job_fields(self, job_id: str, *fields: str) -> list[str | None]:
        """Fields of the job record (`status` first). A replica without the job (still
        syncing after a failover, or cut off from its master while the job was created) is not
        proof that there is none: the master is asked, and if it has the job, the job is read
        there from then on, its events too, so that its stream is neither refused (404) nor
        ended early (no status reads as ended) nor left without its log."""
        values = await self._node(job_id).hmget(job_keys(job_id).job, list(fields))
        if values[0] is None and self._master is not None and job_id not in self._on_master:
            values = await self._master.hmget(job_keys(job_id).job, list(fields))
            if values[0] is not None:
                log.info("job %s: the replica does not have it yet; read from the master",
                         job_id)
                self._on_master[job_id] = None
                while len(self._on_master) > ON_MASTER_MAX:  # the oldest first
                    del self._on_master[next(iter(self._on_master))]
        return values

    # -- housekeeping -------------------------------------------------------------------
    async def ping(self) -> bool:
        """True if Redis answers and takes writes; ReadOnlyError naming the master a replica
        follows, ConnectionError if it does not answer (readiness says why)."""
        await check_writable(self._master or self.redis)
        return True

    def stats(self) -> dict[str, int]:
        return {"channels": len(self._fanout.channels()), "listeners": len(self._fanout)}

    async def aclose(self) -> None:
        """Stop the reader and close every connection."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()
        with contextlib.suppress(Exception):
            await self._pubsub_client.aclose()
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()
        if self._master is not None:
            await self._master.aclose()
            await self._master.connection_pool.disconnect()

    async def _leave(self, name: str, listener: Listener) -> None:
        async with self._lock:
            if not self._fanout.remove(name, listener):
                return
            self._confirmed.pop(name, None)
            try:
                await self._pubsub.unsubscribe(name)
            except Exception as exc:  # the reconnect would resubscribe it; harmless either way
                log.warning("unsubscribe %s failed: %s", name, exc)

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(),
                                                                  name="cortex-sse-hub")

    async def _read_loop(self) -> None:
        backoff = 0.1
        silence = Silence()
        while True:
            try:
                message = await self._pubsub.get_message(timeout=self.poll_s)
                if message is not None:  # a message, or the PONG asked for
                    silence.heard_from()
                elif why := silence.lost():
                    # a frozen node: connect again (redis-py subscribes the new connection to
                    # every channel)
                    if self._pubsub.connection is not None:
                        await self._pubsub.connection.disconnect()
                    raise ConnectionError(why)
                elif silence.due():
                    await self._pubsub.ping()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event hub: pub/sub read failed (%s); clients catch up from the log", exc)
                self._fanout.resync()
                silence = Silence()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if message:
                self._on_message(message)

    def _on_message(self, message: dict[str, Any]) -> None:
        kind, name = message.get("type"), message.get("channel")
        if kind == "message" and isinstance(name, str):
            try:
                event = json.loads(message["data"])
            except (TypeError, ValueError):
                log.warning("event hub: not JSON on %s: %.200r", name, message.get("data"))
                return
            self._fanout.publish(name, event)
        elif kind == "subscribe" and isinstance(name, str):
            confirmed = self._confirmed.get(name)
            if confirmed is not None:
                confirmed.set()
