"""Job state in Redis: the job hash, per-action state, variables and the event log.

Every mutation is one Lua script (see lua/), so the seq, the stream entry and the publish of an
event, and the state change that caused it, happen atomically.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# Job keys, in the order the scripts expect them (KEYS[1..16]; the conversation is Python's).
_SUFFIXES = ("job", "spec", "status", "result", "pending", "poison", "deps", "vars", "lease",
             "wait", "seq", "events", "onerr", "attempts", "await", "inbox", "conversation")
TERMINAL = frozenset({"ok", "error", "timeout", "skipped", "cancelled"})
JOB_TERMINAL = frozenset({"completed", "failed", "cancelled"})
JOBS_INDEX = "cx:jobs"
#: Pub/sub channel on which `close` publishes the id of every job that ends.
ENDED_CHANNEL = "cx:ended"
RECONNECT_RETRIES = 40  # with a 1 s backoff cap: about 35 s without Redis
#: The tenant of jobs and sessions created without API keys configured.
DEFAULT_TENANT = "default"


def tenant_index(tenant: str) -> str:
    """The per-tenant job index (the global `JOBS_INDEX` holds every job)."""
    return f"{JOBS_INDEX}:{tenant}"


def job_keys(job_id: str) -> list[str]:
    """The Redis keys of one job; the `{job_id}` hash tag keeps them on one shard."""
    return [f"cx:{{{job_id}}}:{suffix}" for suffix in _SUFFIXES]


def channel(job_id: str) -> str:
    """The pub/sub channel a job's events are published on."""
    return f"cx:ev:{job_id}"


@cache
def _lua(name: str) -> str:
    folder = resources.files("cortex_worker") / "lua"
    return (folder / "prelude.lua").read_text() + "\n" + (folder / f"{name}.lua").read_text()


def dumps(value: Any) -> str:
    """Compact JSON, as stored in Redis."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def _event_args(events: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Events as script arguments: kind, data, kind, data ..."""
    return [part for kind, data in events for part in (kind, dumps(data))]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What a state change asks for: actions to send now and whether the job drained."""

    ready: list[dict[str, Any]]  # specs of the actions to send now
    drained: bool
    recorded: bool = True  # False: nothing changed (already recorded, or the job has ended)


class Store:
    """All reads and writes of job state go through here."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._scripts = {name: client.register_script(_lua(name))
                         for name in ("emit", "register", "claim", "finish", "retry", "close", "requeue",
                                      "resume", "begin")}

    @classmethod
    def from_url(cls, url: str) -> Store:
        # Ride out a Redis restart (or failover) of up to ~35 s: a command whose connection
        # fails is sent again after a backoff, instead of failing the task and losing the
        # result it was recording (redis-py's default gives up after well under a second).
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), RECONNECT_RETRIES)
        return cls(redis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                        retry=retry))

    def _run(self, name: str, job_id: str, *args: Any) -> Any:
        argv = [job_id, repr(time.time()), *args]
        return self._scripts[name](keys=job_keys(job_id)[:16], args=argv)

    # -- jobs -----------------------------------------------------------------------------
    def create_job(self, job_id: str, fields: dict[str, Any], ttl: int,
                   events: Sequence[tuple[str, dict[str, Any]]] = ()) -> None:
        """Create the job hash, index it, and append its first events."""
        key = job_keys(job_id)[0]
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping={"id": job_id, "status": "queued", "created_at": repr(now),
                                "ttl": str(ttl), "remaining": 0, "running": 0, "failures": 0,
                                **{k: v if isinstance(v, str) else dumps(v)
                                   for k, v in fields.items()}})
        pipe.expire(key, ttl)
        pipe.zadd(JOBS_INDEX, {job_id: now})
        if fields.get("tenant"):
            pipe.zadd(tenant_index(fields["tenant"]), {job_id: now})
        pipe.execute()
        if events:
            self.emit(job_id, events)

    def set_job(self, job_id: str, **fields: Any) -> None:
        self.redis.hset(job_keys(job_id)[0], mapping={
            k: v if isinstance(v, str) else dumps(v) for k, v in fields.items()})

    def get_job(self, job_id: str) -> dict[str, str] | None:
        data = self.redis.hgetall(job_keys(job_id)[0])
        return data or None

    def list_jobs(self, limit: int = 50, offset: int = 0, tenant: str | None = None) -> list[str]:
        """Job ids, newest first: every job, or (`tenant`) only that tenant's."""
        index = JOBS_INDEX if tenant is None else tenant_index(tenant)
        return self.redis.zrevrange(index, offset, offset + limit - 1)

    def actions(self, job_id: str) -> dict[str, dict[str, Any]]:
        """Every action of the job: its spec, status and result record."""
        keys = job_keys(job_id)
        pipe = self.redis.pipeline()
        pipe.hgetall(keys[1])
        pipe.hgetall(keys[2])
        pipe.hgetall(keys[3])
        pipe.hgetall(keys[13])
        specs, statuses, results, attempts = pipe.execute()
        out: dict[str, dict[str, Any]] = {}
        for action_id, spec in specs.items():
            out[action_id] = {
                "spec": json.loads(spec),
                "status": statuses.get(action_id, "pending"),
                "attempts": int(attempts.get(action_id, 0)),
                "result": json.loads(results[action_id]) if action_id in results else None,
            }
        return out

    def add_child(self, job_id: str, child_id: str) -> None:
        key = f"cx:{{{job_id}}}:children"
        ttl = int(self.redis.hget(job_keys(job_id)[0], "ttl") or 604800)
        pipe = self.redis.pipeline()
        pipe.sadd(key, child_id)
        pipe.expire(key, ttl)
        pipe.execute()

    def children(self, job_id: str) -> set[str]:
        return self.redis.smembers(f"cx:{{{job_id}}}:children")

    def ids_with_status(self, job_id: str, status: str) -> set[str]:
        return {a for a, st in self.redis.hgetall(job_keys(job_id)[2]).items() if st == status}

    def spec(self, job_id: str, action_id: str) -> dict[str, Any] | None:
        raw = self.redis.hget(job_keys(job_id)[1], action_id)
        return json.loads(raw) if raw else None

    def variables(self, job_id: str, names: Iterable[str]) -> dict[str, Any]:
        names = list(names)
        if not names:
            return {}
        values = self.redis.hmget(job_keys(job_id)[7], names)
        return {n: json.loads(v) for n, v in zip(names, values, strict=True) if v is not None}

    def set_variables(self, job_id: str, values: dict[str, Any]) -> None:
        if values:
            self.redis.hset(job_keys(job_id)[7], mapping={k: dumps(v) for k, v in values.items()})

    # -- sessions -------------------------------------------------------------------------
    def create_session(self, session_id: str, agent: str, options: dict[str, Any], ttl: int,
                       tenant: str = DEFAULT_TENANT) -> None:
        key = f"cx:session:{session_id}"
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping={"id": session_id, "agent": agent, "created_at": repr(time.time()),
                                "options": dumps(options), "ttl": str(ttl), "tenant": tenant})
        pipe.expire(key, ttl)
        pipe.execute()

    def get_session(self, session_id: str) -> dict[str, Any] | None:
        key = f"cx:session:{session_id}"
        pipe = self.redis.pipeline()
        pipe.hgetall(key)
        pipe.lrange(f"{key}:messages", 0, -1)
        pipe.lrange(f"{key}:jobs", 0, -1)
        data, messages, jobs = pipe.execute()
        if not data:
            return None
        return {**data, "messages": [json.loads(m) for m in messages], "jobs": jobs}

    def append_session(self, session_id: str, message: dict[str, Any] | None = None,
                       job_id: str | None = None) -> None:
        key = f"cx:session:{session_id}"
        ttl = int(self.redis.hget(key, "ttl") or 604800)
        pipe = self.redis.pipeline()
        if message is not None:
            pipe.rpush(f"{key}:messages", dumps(message))
        if job_id is not None:
            pipe.rpush(f"{key}:jobs", job_id)
        for suffix in ("", ":messages", ":jobs"):
            pipe.expire(key + suffix, ttl)
        pipe.execute()

    # -- events ---------------------------------------------------------------------------
    def emit(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]], *,
             live: bool = False) -> int:
        """Append events to the job's log; returns the last seq. `live`: only if the job has
        not ended (0 is returned then): a turn's output never follows `job_cancelled`."""
        args = _event_args(events)
        return int(self._run("emit", job_id, "1" if live else "0", *args)) if args else 0

    def events_after(self, job_id: str, after: int = 0, count: int | None = None) -> list[dict[str, Any]]:
        """Events with seq > `after`, in order."""
        entries = self.redis.xrange(job_keys(job_id)[11], min=f"{after + 1}-0", count=count)
        return [json.loads(fields["e"]) for _, fields in entries]

    # -- actions --------------------------------------------------------------------------
    def begin(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]]) -> str:
        """Start a queued document or workflow job and log `events`: "started", "running"
        (it had begun: a redelivered start) or "ended" (cancelled before it began)."""
        return str(self._run("begin", job_id, *_event_args(events)))

    def register(self, job_id: str, actions: Sequence[dict[str, Any]], *, close: bool) -> Dispatch:
        """Add actions (`id, spec, deps, after, on_error`) to the job; return those ready now.
        Nothing is registered once the job has ended (`recorded` is then False)."""
        out = self._run("register", job_id, dumps(list(actions)), "1" if close else "0")
        if out == ["ended"]:
            return Dispatch(ready=[], drained=False, recorded=False)
        bar = out.index("|")
        return Dispatch(ready=[{"id": i} for i in out[:bar]], drained=bool(int(out[bar + 1])))

    def claim(self, job_id: str, action_id: str, owner: str, lease_s: float,
              names: Sequence[str] = (), *, force: bool = False) -> list[Any]:
        return self._run("claim", job_id, action_id, owner, repr(lease_s), "1" if force else "0", *names)

    def finish(self, job_id: str, action_id: str, status: str, record: dict[str, Any],
               value: Any, output_key: str | None, event: tuple[str, dict[str, Any]]) -> Dispatch:
        """Record an action's end once and walk its dependents."""
        out = self._run("finish", job_id, action_id, status, dumps(record), dumps(value),
                        output_key or "", event[0], dumps(event[1]))
        return Dispatch(ready=[json.loads(x) for x in out[2:]], drained=bool(int(out[1])),
                        recorded=bool(int(out[0])))

    def queued_dependents(self, job_id: str, action_id: str) -> list[dict[str, Any]]:
        """Specs of dependents marked queued: to send again after a worker died mid-dispatch."""
        return [json.loads(x) for x in self._run("requeue", job_id, action_id)]

    def resume(self, job_id: str, owner: str = "", lease_s: float = 30.0,
               dead_owner: str = "") -> tuple[int, list[str], bool]:
        """Begin an agent's next turn as `owner`, or take over the turn in progress if its
        owner is `dead_owner` or its lease expired (see lua/resume.lua). Returns (turn,
        actions finished before it, restarted); turn 0 if no turn is due."""
        out = self._run("resume", job_id, owner, repr(lease_s), dead_owner)
        if not int(out[0]):
            return 0, [], False
        return int(out[0]), list(out[2:]), bool(int(out[1]))

    def results(self, job_id: str, action_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Result records of the given actions (those recorded)."""
        if not action_ids:
            return {}
        values = self.redis.hmget(job_keys(job_id)[3], list(action_ids))
        return {a: json.loads(v) for a, v in zip(action_ids, values, strict=True) if v is not None}

    def conversation(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.redis.lrange(job_keys(job_id)[16], 0, -1)]

    def append_conversation(self, job_id: str, *messages: dict[str, Any]) -> None:
        key = job_keys(job_id)[16]
        ttl = int(self.redis.hget(job_keys(job_id)[0], "ttl") or 604800)
        pipe = self.redis.pipeline()
        pipe.rpush(key, *[dumps(m) for m in messages])
        pipe.expire(key, ttl)
        pipe.execute()

    def retry(self, job_id: str, action_id: str, data: dict[str, Any]) -> bool:
        return bool(self._run("retry", job_id, action_id, dumps(data)))

    def close(self, job_id: str, status: str, fields: dict[str, Any] | None = None,
              events: Sequence[tuple[str, dict[str, Any]]] = (), *, only_if: str = "") -> list[str] | None:
        """End the job with `status`; unfinished actions are cancelled. None if it had ended."""
        args = _event_args(events)
        out = self._run("close", job_id, status, dumps({k: v if isinstance(v, str) else dumps(v)
                                                         for k, v in (fields or {}).items()}),
                        only_if, *args)
        return None if out is None else list(out)
