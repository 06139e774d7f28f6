"""Redis URLs and the clients built from them: the one place a Cortex process connects to Redis.

`CORTEX_REDIS_URL` is either a plain URL (`redis://`, `rediss://`, `unix://`), handed to
redis-py as it is, or a Sentinel URL, whose master the sentinels name (and rename after a
failover):

    redis+sentinel://[[user]:password@]HOST1:PORT1,HOST2:PORT2,.../MASTER_NAME[/DB][?sentinel_password=...]

`password` (and `user`) authenticate to the master, `sentinel_password` to the sentinels
(Sentinel's own `requirepass`); a port left out is 26379. The state store and the API's SSE
hub use redis-py's `Sentinel(...).master_for(...)`; Celery's broker and result backend use
kombu's and Celery's Sentinel support (`sentinel://` URLs and `master_name` in the transport
options), from `celery_broker_config` and `celery_backend_config`.

No connection waits for a node forever: a master that freezes (SIGSTOP, a paused VM, a
partition that drops packets) keeps its connections open, so each client bounds its reads
(`READ_TIMEOUT_S`, and the broker's `celery_socket_options`) and probes idle connections
(`keepalive_options`); a command that timed out is sent again, to the master the sentinels
name by then.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFoundError
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import NoPermissionError, ReadOnlyError
from redis.retry import Retry
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)

from cortex_worker.errors import CortexError

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_SENTINEL_PORT = 26379
CONNECT_TIMEOUT_S = 2.0
"""How long one attempt to open a connection may take: a host that drops packets (a partition)
fails each attempt after this long instead of the kernel's two minutes."""
SENTINEL_TIMEOUT_S = 2.0
"""How long a sentinel may take to answer which node is the master, before the next is asked."""
PUBSUB_PING_S = 5.0
"""A subscribed connection that heard nothing this long asks for a PONG (`Silence`)."""
SUBSCRIBER_PROTOCOL = 2
"""The protocol of the clients that hold subscriptions (the job-end listener's, the API's event
hub's). redis-py 8 speaks RESP3 by default, where Redis answers a PING in a subscription with a
plain PONG, which redis-py's pub/sub parser, with decoded responses, drops as a malformed message:
`Silence` would never hear its answer. RESP2 answers `["pong", ""]`, a message it returns."""
READ_TIMEOUT_S = 5.0
"""How long a command may wait for its reply, beyond a wait it asks of the server itself: a
master that froze with the command sent (its kernel still holds the connection open) fails it
with a TimeoutError after this long, and the client's retry sends it again, to the master the
sentinels name by then. Every command Cortex sends is answered in milliseconds (Lua scripts
too) except `WAIT`, whose `redis_replica_wait_ms` the state store adds to this. A pub/sub read
is not bounded by it: it passes a timeout of its own, and an idle subscription is probed by
TCP keepalive instead (`keepalive_options`)."""
KEEPALIVE_IDLE_S = 10
"""Seconds a connection may sit idle before the kernel probes its peer (Linux's default: 2 h)."""
KEEPALIVE_INTERVAL_S = 5
"""Seconds between two probes of an idle connection."""
KEEPALIVE_PROBES = 3
"""Probes unanswered before the kernel closes the connection: a peer gone without a FIN or an
RST (a partition, a paused VM, a host powered off) is noticed within 10 + 3 x 5 = 25 s."""
BROKER_HEALTH_CHECK_S = 5
"""kombu's health checks of the broker's connections, this often: a BRPOP whose reply is
`brpop_timeout` (1 s) + this overdue is dropped and sent again on a new connection, and a
pub/sub connection that missed two PINGs' replies is dropped and subscribed again (kombu's
default, 25 s, leaves a worker up to 51 s on a frozen master; redis-py also PINGs a
connection idle this long before its next command)."""


class RedisUrlError(CortexError, ValueError):
    """A Redis URL Cortex cannot use; the message says which part is wrong (a ValueError:
    the settings' validators report it as the field's error)."""


class PlainTarget(BaseModel):
    """A `redis://`, `rediss://` or `unix://` URL: redis-py and kombu read it as it is."""

    model_config = ConfigDict(frozen=True)

    url: str


class SentinelTarget(BaseModel):
    """A `redis+sentinel://` URL, parsed: the sentinels to ask, the master's name and the db."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sentinels: tuple[tuple[str, int], ...] = Field(min_length=1)
    master_name: str = Field(min_length=1)
    db: int = Field(default=0, ge=0)
    username: str | None = None
    password: SecretStr | None = None
    sentinel_password: SecretStr | None = None

    def master_kwargs(self) -> dict[str, Any]:
        """Connection options for the master's connections: its db and credentials."""
        kwargs: dict[str, Any] = {"db": self.db}
        if self.username:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password.get_secret_value()
        return kwargs

    def sentinel_kwargs(self, retry: Retry | AsyncRetry | None = None) -> dict[str, Any]:
        """Connection options for the sentinels: short timeouts (a dead sentinel is skipped
        for the next one), Sentinel's own password, and `retry` if given: our clients ask each
        sentinel once per look, since redis-py's default would retry a dead one ten times and
        their own retries repeat the whole look (Celery's options hold no Retry: it must be
        able to show them as JSON)."""
        kwargs: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S,
                                  "socket_connect_timeout": SENTINEL_TIMEOUT_S}
        if retry is not None:
            kwargs["retry"] = retry
        if self.sentinel_password is not None:
            kwargs["password"] = self.sentinel_password.get_secret_value()
        return kwargs

    def celery_url(self) -> str:
        """kombu's and Celery's form: one `sentinel://` URL per sentinel, joined with `;`
        (each carries the master's credentials and db, as they read them from the first)."""
        auth = ""
        if self.username or self.password is not None:
            secret = self.password.get_secret_value() if self.password is not None else ""
            auth = f"{quote(self.username or '', safe='')}:{quote(secret, safe='')}@"
        return ";".join(f"sentinel://{auth}{_host(host)}:{port}/{self.db}"
                        for host, port in self.sentinels)

    def transport_options(self) -> dict[str, Any]:
        """What kombu's Sentinel channel and Celery's Sentinel backend need beside the URL."""
        return {"master_name": self.master_name, "sentinel_kwargs": self.sentinel_kwargs()}


RedisTarget = PlainTarget | SentinelTarget


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_redis_url(url: str) -> bool:
    """The URL names a Redis (plain or Sentinel), not another broker (`amqp://`, ...)."""
    return url.partition("://")[0].lower() in (*PLAIN_SCHEMES, SENTINEL_SCHEME)


def parse_url(url: str) -> RedisTarget:
    """`url` as a target; RedisUrlError naming the part that is wrong."""
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in (*PLAIN_SCHEMES, SENTINEL_SCHEME):
        raise RedisUrlError(
            f"a Redis URL starts with redis://, rediss://, unix:// or {SENTINEL_SCHEME}:// "
            f"(got {redact(url)!r})")
    if scheme != SENTINEL_SCHEME:
        return PlainTarget(url=url)
    return _parse_sentinel(url)


def _parse_sentinel(url: str) -> SentinelTarget:
    where = f"{SENTINEL_SCHEME} URL {redact(url)!r}"
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed [ of an IPv6 address
        raise RedisUrlError(f"{where}: {exc}") from None
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_sentinel_address(item, where) for item in hosts.split(","))
    segments = [unquote(s) for s in parts.path.split("/")[1:]]
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    if not segments or not segments[0]:
        raise RedisUrlError(f"{where}: the master's name is missing: write "
                            f"{SENTINEL_SCHEME}://HOST:PORT,HOST:PORT/MASTER_NAME/DB")
    if len(segments) > 2:
        raise RedisUrlError(f"{where}: the path is /MASTER_NAME or /MASTER_NAME/DB, "
                            f"not {parts.path!r}")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise RedisUrlError(f"{where}: the db must be a number >= 0 (got {segments[1]!r})")
        db = int(segments[1])
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"sentinel_password"})
    if unknown:
        raise RedisUrlError(f"{where}: unknown option(s) {', '.join(unknown)}; the only one is "
                            "sentinel_password")
    sentinel_password = query.get("sentinel_password", [None])[-1]
    return SentinelTarget(
        sentinels=sentinels, master_name=segments[0], db=db, username=username,
        password=SecretStr(password) if password is not None else None,
        sentinel_password=SecretStr(sentinel_password) if sentinel_password is not None else None)


def _sentinel_address(item: str, where: str) -> tuple[str, int]:
    """`host`, `host:port` or `[v6]:port` as (host, port)."""
    if item.startswith("["):
        host, bracket, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else rest
        if not bracket or (rest and not rest.startswith(":")):
            raise RedisUrlError(f"{where}: bad sentinel address {item!r}")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise RedisUrlError(f"{where}: a sentinel's host is empty (in {item!r}); list them as "
                            "HOST1:PORT1,HOST2:PORT2")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RedisUrlError(f"{where}: sentinel {item!r} has a bad port {port_text!r}")
    return host, int(port_text)


_PASSWORD_PARAM = re.compile(r"([?&;][^=&;#]*password=)[^&;#]*", re.IGNORECASE)
_URL_START = re.compile(r";(?=[a-z][a-z0-9+.-]*://)", re.IGNORECASE)


def redact(url: str) -> str:
    """`url` without its passwords, for messages and logs: its user part's (a Sentinel URL
    has one, before its first host) and its query's (`password=`, `sentinel_password=`);
    each URL of kombu's lists joined with `;` too."""
    return ";".join(_redact_one(part) for part in _URL_START.split(url))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The authority ends at the first "/" (an unencoded "?" or "#" may be in the password).
    slash = rest.find("/")
    authority, tail = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
    userinfo, _, hosts = authority.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if colon:
        authority = f"{user}:***@{hosts}"
    return scheme + sep + _PASSWORD_PARAM.sub(r"\1***", authority + tail)


# -- clients -------------------------------------------------------------------------------
class _SentinelConnection(SentinelManagedConnection):
    """redis-py's connection to a Sentinel-named node, that asks the sentinels again whenever
    it reconnects. redis-py (8.1) asks them only in `connect()`, which a connection taken from
    the pool goes through; a command whose connection broke under it (the master killed while
    a write waited for its replica) is sent again by `send_packed_command`, which reconnects
    through `connect_check_health` to the address it had: the dead master, every retry, until
    the write failed after about 35 s with the replica long promoted.

    That reconnect is one look and one attempt: the command's own retry makes the next ones.
    `connect()` would retry too, inside each of them: against a frozen master the sentinels
    still name (each attempt waits for its read timeout), 40 x 40 attempts of 6 s each."""

    def connect_check_health(self, check_health: bool = True,
                             retry_socket_connect: bool = True) -> None:
        if self._sock is None and retry_socket_connect:  # not from connect_to: look again
            self._connect_retry()
            return
        super().connect_check_health(check_health=check_health,
                                     retry_socket_connect=retry_socket_connect)


class _AsyncSentinelConnection(AsyncSentinelConnection):
    """The asyncio form of `_SentinelConnection`."""

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        if not self.is_connected and retry_socket_connect:
            await self._connect_retry()
            return
        await super().connect_check_health(check_health=check_health,
                                           retry_socket_connect=retry_socket_connect)


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool, whose callers wait for a free connection (up to `timeout`)
    instead of failing when `max_connections` are in use, as `BlockingConnectionPool` does."""


class _AsyncBlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """The asyncio form of `_BlockingSentinelPool`."""


class Silence:
    """Whether a subscribed connection, which sends nothing while it listens, is on a node that
    froze with it open (a paused VM, a partition: the kernel still acknowledges what is sent,
    so nothing fails): after `PUBSUB_PING_S` without a message its reader sends a PING
    (`due`), and no answer within `READ_TIMEOUT_S` means it must connect again (`lost`). The
    job-end listener and the API's event hub read their pub/sub through one."""

    def __init__(self) -> None:
        self.heard, self.asked = time.monotonic(), None  # type: float, float | None

    def heard_from(self) -> None:
        """A message came (or the PONG asked for)."""
        self.heard, self.asked = time.monotonic(), None

    def due(self) -> bool:
        """Time to send a PING (the caller sends it)."""
        if self.asked is None and time.monotonic() - self.heard > PUBSUB_PING_S:
            self.asked = time.monotonic()
            return True
        return False

    def lost(self) -> str | None:
        """Why the connection must be made again, or None."""
        if self.asked is not None and (waited := time.monotonic() - self.asked) > READ_TIMEOUT_S:
            return f"no answer to a PING in {waited:.0f} s"
        return None


def keepalive_options() -> dict[int, int]:
    """TCP keepalive for every Redis connection, as `socket_keepalive_options`: an idle
    connection (a pub/sub subscription, a pooled one) whose peer is gone without a FIN or an
    RST is closed within 25 s (`KEEPALIVE_*`), and so is one whose sent bytes go that long
    unacknowledged (TCP_USER_TIMEOUT: the kernel would retransmit them for about 15 minutes).
    A node that is frozen but whose kernel still answers (SIGSTOP) passes these probes: the
    read timeouts bound what waits for it. Only the options this platform has."""
    wanted = {"TCP_KEEPIDLE": KEEPALIVE_IDLE_S, "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_S,
              "TCP_KEEPCNT": KEEPALIVE_PROBES,
              "TCP_USER_TIMEOUT": (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES)
              * 1000}
    return {getattr(socket, name): value for name, value in wanted.items()
            if hasattr(socket, name)}


def _socket_options(target: RedisTarget, *, socket_timeout: float | None,
                    socket_connect_timeout: float) -> dict[str, Any]:
    """The timeouts of a client's connections, and TCP keepalive unless it is a unix socket's
    (whose connections take no TCP option)."""
    options: dict[str, Any] = {"socket_timeout": socket_timeout,
                               "socket_connect_timeout": socket_connect_timeout}
    if not (isinstance(target, PlainTarget) and target.url.lower().startswith("unix://")):
        options.update(socket_keepalive=True, socket_keepalive_options=keepalive_options())
    return options


def _client_options(target: RedisTarget, retry: Retry | AsyncRetry, decode_responses: bool,
                    health_check_interval: int, socket_timeout: float | None,
                    socket_connect_timeout: float, protocol: int | None) -> dict[str, Any]:
    """What every client is built with, sync or asyncio (`protocol` None: redis-py's)."""
    options: dict[str, Any] = {
        "decode_responses": decode_responses, "retry": retry,
        "health_check_interval": health_check_interval,
        **_socket_options(target, socket_timeout=socket_timeout,
                          socket_connect_timeout=socket_connect_timeout)}
    if protocol is not None:
        options["protocol"] = protocol
    return options


def sync_client(url: str, *, retry: Retry, max_connections: int, pool_timeout: float,
                socket_connect_timeout: float = CONNECT_TIMEOUT_S,
                socket_timeout: float | None = READ_TIMEOUT_S, decode_responses: bool = True,
                health_check_interval: int = 30, protocol: int | None = None) -> redis.Redis:
    """A client of the Redis `url` names (its master, for a Sentinel URL), on a blocking pool
    of `max_connections`; a command whose connection fails, or whose reply does not come
    within `socket_timeout`, is sent again as `retry` says (after a failover, to the master
    the sentinels name then)."""
    target = parse_url(url)
    options = {**_client_options(target, retry, decode_responses, health_check_interval,
                                 socket_timeout, socket_connect_timeout, protocol),
               "max_connections": max_connections, "timeout": pool_timeout}
    if isinstance(target, PlainTarget):
        return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(url, **options))
    sentinel = Sentinel(list(target.sentinels),
                        sentinel_kwargs=target.sentinel_kwargs(Retry(NoBackoff(), 0)))
    client: redis.Redis = sentinel.master_for(
        target.master_name, connection_pool_class=_BlockingSentinelPool,
        connection_class=_SentinelConnection, **target.master_kwargs(), **options)
    return client


def subscriber_client(url: str) -> redis.Redis:
    """A client for one process's subscriptions (the job-end listener's): RESP2
    (`SUBSCRIBER_PROTOCOL`), reads bounded by its reader's poll, and a broken connection made
    again a few times with a backoff (through the sentinels, for a Sentinel URL)."""
    return sync_client(url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
                       max_connections=2, pool_timeout=30.0, protocol=SUBSCRIBER_PROTOCOL)


def async_client(url: str, *, retry: AsyncRetry, max_connections: int | None = None,
                 pool_timeout: float = 30.0, socket_connect_timeout: float = CONNECT_TIMEOUT_S,
                 socket_timeout: float | None = READ_TIMEOUT_S, decode_responses: bool = True,
                 health_check_interval: int = 30, replica: bool = False,
                 protocol: int | None = None) -> aioredis.Redis:
    """The asyncio client of `url` (its master, for a Sentinel URL; with `replica`, one of its
    replicas, the master if it has none): on a blocking pool when `max_connections` is given,
    else on a pool of its own without a cap (pub/sub). A reply that does not come within
    `socket_timeout` fails the command, which `retry` sends again; a pub/sub read passes its
    own timeout instead (redis-py 8: `get_message(timeout=...)`), so an idle subscription
    does not time out."""
    target = parse_url(url)
    options = _client_options(target, retry, decode_responses, health_check_interval,
                              socket_timeout, socket_connect_timeout, protocol)
    if max_connections is not None:
        options.update(max_connections=max_connections, timeout=pool_timeout)
    if isinstance(target, PlainTarget):
        if max_connections is None:
            return aioredis.Redis.from_url(url, **options)
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, **options))
    sentinel = AsyncSentinel(list(target.sentinels),
                             sentinel_kwargs=target.sentinel_kwargs(AsyncRetry(NoBackoff(), 0)))
    pool_class = AsyncSentinelPool if max_connections is None else _AsyncBlockingSentinelPool
    pick = sentinel.slave_for if replica else sentinel.master_for
    client: aioredis.Redis = pick(
        target.master_name, connection_pool_class=pool_class,
        connection_class=_AsyncSentinelConnection, **target.master_kwargs(), **options)
    return client


def describe(error: Exception) -> str:
    """`error` in a line for a response or a log: redis-py's "No master found" lists the
    repr of every sentinel's client after " : ", which says nothing more."""
    text = str(error) or type(error).__name__
    if isinstance(error, (MasterNotFoundError, AsyncMasterNotFoundError)):
        return text.split(" : ", 1)[0] + " (no sentinel answered, or none names a master that is up)"
    return text


def read_only_reason(role: list[Any]) -> str | None:
    """Why a node whose `ROLE` answered `role` cannot take writes, or None if it can."""
    kind = str(role[0]) if role else ""
    if kind == "master":
        return None
    if kind == "slave" and len(role) >= 3:
        return f"Redis is read-only (a replica of {role[1]}:{role[2]})"
    return f"Redis is read-only (its role is {kind or 'unknown'})"


async def check_writable(client: aioredis.Redis) -> None:
    """Raise ReadOnlyError if `client`'s node is a replica (the old master after a failover,
    or a URL that names a replica); a ConnectionError if it does not answer. A user whose ACL
    forbids ROLE gets the PING's answer alone."""
    try:
        role = await client.execute_command("ROLE")
    except NoPermissionError:
        await client.ping()
        return
    reason = read_only_reason(list(role))
    if reason is not None:
        raise ReadOnlyError(reason)


# -- Celery --------------------------------------------------------------------------------
def celery_broker_config(url: str) -> dict[str, Any]:
    """Celery's `broker_url` for `url`, and for a Sentinel URL the transport options it needs
    (to merge into `broker_transport_options`); any other broker (amqp://...) as it is."""
    if not is_redis_url(url):
        return {"broker_url": url, "broker_transport_options": {}}
    target = parse_url(url)
    if isinstance(target, PlainTarget):
        return {"broker_url": url, "broker_transport_options": {}}
    return {"broker_url": target.celery_url(),
            "broker_transport_options": target.transport_options()}


def celery_backend_config(url: str) -> dict[str, Any]:
    """Celery's `result_backend` for `url`, and for a Sentinel URL the transport options it
    needs (to merge into `result_backend_transport_options`)."""
    target = parse_url(url)
    if isinstance(target, PlainTarget):
        return {"result_backend": url, "result_backend_transport_options": {}}
    return {"result_backend": target.celery_url(),
            "result_backend_transport_options": target.transport_options()}


def celery_backend_socket_config(url: str) -> dict[str, Any]:
    """The Celery settings that bound the result backend's reads as `celery_socket_options`
    bounds the broker's (Celery reads them from `app.conf`, not from its transport options;
    its own read timeout is 120 s): chords join there, and context feeds wait there for
    `invoke`. A result's wait reads with its own short poll, which the timeout never cuts."""
    if not is_redis_url(url):
        return {}
    config: dict[str, Any] = {"redis_socket_timeout": READ_TIMEOUT_S,
                              "redis_socket_connect_timeout": CONNECT_TIMEOUT_S,
                              "redis_backend_health_check_interval": BROKER_HEALTH_CHECK_S}
    if not url.lower().startswith("unix://"):
        config["redis_socket_keepalive"] = True
    return config


def celery_socket_options(url: str) -> dict[str, Any]:
    """kombu's Redis transport options that keep the broker's connections off a frozen
    master (to merge into `broker_transport_options`; {} for another broker): a command's
    reply waits `READ_TIMEOUT_S` at most (a BRPOP is read only once its reply is there, so
    its own timeout is not cut short), connections are opened within `CONNECT_TIMEOUT_S` and
    kept alive as the state store's are, and kombu's checks of its BRPOP and pub/sub
    connections run every `BROKER_HEALTH_CHECK_S`."""
    if not is_redis_url(url):
        return {}
    options: dict[str, Any] = {"socket_timeout": READ_TIMEOUT_S,
                               "socket_connect_timeout": CONNECT_TIMEOUT_S,
                               "health_check_interval": BROKER_HEALTH_CHECK_S}
    if not url.lower().startswith("unix://"):
        options.update(socket_keepalive=True, socket_keepalive_options=keepalive_options())
    return options
