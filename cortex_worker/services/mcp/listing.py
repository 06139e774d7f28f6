"""MCP tool listings shared through Cortex's Redis: one `tools/list` per server configuration
for the whole cluster, instead of one per process that loads the manifests.

Loading the manifests needs each unpinned MCP server's tools (`spec.needs_listing`). The API
and every worker load them at start-up; asking the server each time means starting a stdio
server (and importing the MCP SDK) in every process. `SharedListing` asks Redis first:

- `cx:mcp:tools:<digest>` holds a server's listing (JSON) for `mcp_listing_ttl_s`; the digest
  is of what the listing depends on (command, directory, env, url, headers, startup timeout),
  so a changed manifest is listed again;
- a process that finds no listing takes `cx:mcp:tools:<digest>:lock` (SET NX, for the
  server's `startup_timeout_s` and a margin), lists the server itself
  (`client.list_tools`) and writes the answer; processes starting at the same time wait for
  it instead of starting the server too. A failure is kept for `FAILURE_TTL_S` only, so the
  waiting processes report the same error, and a later start asks the server again;
- the relic pool refreshes a listing whenever it connects to a server (its session lists the
  tools anyway: `publish`), and drops it when the server sends
  `notifications/tools/list_changed` (`forget`): the next process to load lists it again.

Redis that cannot be reached (`cortex validate` on a laptop) is not an error: the process then
lists the servers itself, as it would without sharing. Nothing here imports the MCP SDK.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from cortex_worker.services.mcp.spec import MCPServerSpec, config_key
from cortex_worker.store.keys import mcp_listing_key
from cortex_worker.tools.errors import ToolError

log = logging.getLogger(__name__)

Listed = dict[str, list[dict[str, Any]] | Exception]
"""Server name -> its tools (`tools/list`), or why they cannot be listed."""
Lister = Callable[[Sequence[MCPServerSpec]], Listed]

FAILURE_TTL_S = 10
"""How long a failed listing is kept: long enough for the processes that waited for it."""
LOCK_MARGIN_S = 15
"""The lock outlives the lister's `startup_timeout_s` by this much (a stdio server's stop)."""
POLL_S = 0.1
"""How often a waiting process looks for the listing another one is making."""
CONNECT_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 2.0


def listing_key(spec: MCPServerSpec) -> str:
    """The Redis key of a server's shared listing."""
    return mcp_listing_key(hashlib.sha256(config_key(spec).encode()).hexdigest()[:32])


def list_here(servers: Sequence[MCPServerSpec]) -> Listed:
    """Ask the servers in this process (`client.list_tools`; imports the MCP SDK)."""
    from cortex_worker.services.mcp.client import list_tools

    return list_tools(servers)


def _decode(raw: str) -> list[dict[str, Any]] | Exception:
    value = json.loads(raw)
    if isinstance(value, dict) and "error" in value:
        return ToolError(value["error"])
    return value["tools"]  # type: ignore[no-any-return]


class SharedListing:
    """A `Lister` that shares listings through Redis (see the module); callable."""

    def __init__(self, client: redis.Redis, ttl_s: float,
                 list_servers: Lister = list_here) -> None:
        self.redis = client
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.list_servers = list_servers

    def __call__(self, servers: Sequence[MCPServerSpec]) -> Listed:
        try:
            return self._shared(servers)
        except redis.RedisError as exc:
            log.info("MCP tool listings not shared (Redis: %s): listing here", exc)
            return self.list_servers(servers)

    def _shared(self, servers: Sequence[MCPServerSpec]) -> Listed:
        results: Listed = {}
        pending = {spec.name: spec for spec in servers}
        token = uuid.uuid4().hex
        deadline = time.monotonic() + max((s.startup_timeout_s for s in servers), default=0) \
            + 2 * LOCK_MARGIN_S
        while pending:
            specs = list(pending.values())
            found = self.redis.mget([listing_key(spec) for spec in specs])
            mine = []
            for spec, raw in zip(specs, found, strict=True):
                if raw is not None:
                    results[spec.name] = _decode(raw)
                    del pending[spec.name]
                elif self.redis.set(f"{listing_key(spec)}:lock", token, nx=True,
                                    px=int((spec.startup_timeout_s + LOCK_MARGIN_S) * 1000)):
                    mine.append(spec)
            if mine:
                try:
                    listed = self.list_servers(mine)
                    for spec in mine:  # written before the lock goes: no one lists it again
                        with contextlib.suppress(redis.RedisError):
                            self._write(spec, listed[spec.name])
                finally:
                    for spec in mine:
                        with contextlib.suppress(redis.RedisError):
                            self._unlock(spec, token)
                for spec in mine:
                    results[spec.name] = listed[spec.name]
                    del pending[spec.name]
            elif pending:
                if time.monotonic() > deadline:  # the lister hangs: ask them here
                    results.update(self.list_servers(list(pending.values())))
                    break
                time.sleep(POLL_S)
        return results

    def _write(self, spec: MCPServerSpec, answer: list[dict[str, Any]] | Exception) -> None:
        if isinstance(answer, Exception):
            self.redis.set(listing_key(spec), json.dumps({"error": str(answer)}),
                           ex=FAILURE_TTL_S)
        else:
            self.redis.set(listing_key(spec), json.dumps({"tools": answer}), px=self.ttl_ms)

    def _unlock(self, spec: MCPServerSpec, token: str) -> None:
        lock = f"{listing_key(spec)}:lock"
        with self.redis.pipeline() as pipe:  # only our own lock
            try:
                pipe.watch(lock)
                if pipe.get(lock) == token:
                    pipe.multi()
                    pipe.delete(lock)
                    pipe.execute()
            except redis.WatchError:
                pass

    def publish(self, spec: MCPServerSpec, tools: list[dict[str, Any]]) -> None:
        """Refresh a server's listing with what a session just listed."""
        self._write(spec, tools)

    def forget(self, spec: MCPServerSpec) -> None:
        """Drop a server's listing (its tools changed)."""
        self.redis.delete(listing_key(spec))


def shared_listing(url: str, ttl_s: float) -> SharedListing:
    """A `SharedListing` on its own client of the Redis `url`: short timeouts, no retries, so
    that a Redis that is down costs a second, not the state store's long retries."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from cortex_worker.store.connect import sync_client

    client = sync_client(url, retry=Retry(NoBackoff(), 0), max_connections=4, pool_timeout=2,
                         socket_connect_timeout=CONNECT_TIMEOUT_S,
                         socket_timeout=READ_TIMEOUT_S, health_check_interval=0)
    return SharedListing(client, ttl_s)
