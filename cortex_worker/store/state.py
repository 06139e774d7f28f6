"""Job state in Redis: the job hash, per-action state, variables and the event log.

Every mutation is one Lua script (see lua/), so the seq, the stream entry and the publish of an
event, and the state change that caused it, happen atomically.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cortex_worker.errors import CortexError
from cortex_worker.jobs.record import DEFAULT_TENANT, JobRecord, encode
from cortex_worker.protocol.events import ACTION_TERMINAL, JOB_TERMINAL, ActionStatus, JobStatus
from cortex_worker.store.connect import READ_TIMEOUT_S, sync_client
from cortex_worker.store.keys import (
    ACTIVE_JOBS,
    DEFAULT_TTL_S,
    JOBS_INDEX,
    MODELS_INDEX,
    REPLICATION_MARK,
    SCRIPT_KEYS,
    TENANT_LANES,
    agui_runs_key,
    alive_key,
    job_keys,
    model_keys,
    remote_tasks_key,
    session_key,
    slot_keys,
    tenant_index,
    tenant_running_key,
    usage_key,
)
from cortex_worker.store.replication import Replication

RECONNECT_RETRIES = 40  # with a 1 s backoff cap: about 35 s without Redis
MAX_CONNECTIONS = 1024
"""Connections one process may open; past that a command waits for one (`POOL_WAIT_S`).
redis-py 6+ caps a plain pool at 100 and then raises: an agent worker runs 200 turns at once
by default, besides its heartbeat, reconciler and result listeners."""
POOL_WAIT_S = 30.0


@cache
def _lua(name: str, prelude: bool = True) -> str:
    """A script's source; a job script's body runs after the prelude, once per write id
    (lua/prelude.lua: `once`)."""
    folder = resources.files("cortex_worker.store") / "lua"
    body = (folder / f"{name}.lua").read_text()
    if not prelude:
        return body
    return (f"{(folder / 'prelude.lua').read_text()}\nlocal function body()\n{body}\nend\n"
            "return once(body)\n")


def _clock(now: float | None = None) -> str:
    """A job script's ARGV[2]: the clock, and a new write id (lua/prelude.lua: `once`)."""
    return f"{time.time() if now is None else now!r}|{os.urandom(8).hex()}"


def dumps(value: Any) -> str:
    """Compact JSON, as stored in Redis."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def _event_args(events: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Events as script arguments: kind, data, kind, data ..."""
    return [part for kind, data in events for part in (kind, dumps(data))]


@dataclass(frozen=True, slots=True)
class ActionState:
    """An unfinished action as the reconciler sees it."""

    status: str  # pending, waiting, queued or running
    owner: str | None  # the lease holder (host:pid), if it was claimed
    lease_until: float | None
    queued_at: float | None  # when it was last queued (or sent again)
    redrives: int  # times the reconciler sent it again
    throttled_at: float | None = None  # when it began to wait for a tool slot
    model_wait_until: float | None = None  # when its model endpoint's known wait ends


def _action_states(statuses: dict[str, str], leases: dict[str, str], timings: dict[str, str],
                   redrives: dict[str, str]) -> dict[str, ActionState]:
    out: dict[str, ActionState] = {}
    for action_id, status in statuses.items():
        if status in ACTION_TERMINAL:
            continue
        owner, expiry = None, None
        if action_id in leases:
            owner, _, until = leases[action_id].rpartition("|")
            expiry = float(until)
        queued = timings.get(f"q|{action_id}")
        throttled = timings.get(f"w|{action_id}")
        model_wait = timings.get(f"m|{action_id}")
        out[action_id] = ActionState(status, owner, expiry, float(queued) if queued else None,
                                     int(redrives.get(action_id, 0)),
                                     float(throttled) if throttled else None,
                                     float(model_wait) if model_wait else None)
    return out


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What a state change asks for: actions to send now and whether the job drained."""

    ready: list[dict[str, Any]]  # specs of the actions to send now
    drained: bool
    recorded: bool = True  # False: nothing changed (already recorded, or the job has ended)


class Fenced(CortexError):
    """A write by a lease holder whose lease was taken over (a paused process that woke up):
    the store refused it and changed nothing (recovery/fencing.py)."""

    def __init__(self, write: str, job_id: str, holder: str) -> None:
        super().__init__(f"{write} of job {job_id} refused: {holder} no longer holds it")
        self.write, self.job_id, self.holder = write, job_id, holder


def _fence(value: int | None) -> str:
    """A fence as a script argument ('' : the write is not fenced)."""
    return "" if value is None else str(value)


class SessionBusy(CortexError):
    """A session message that cannot start a job: the session's last job (`job_id`) is still
    running, or another message started it after the caller read the session."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """A session message that starts a job: recorded with the job in one transaction, and
    only if the session's last job is still `after` (as the caller read it) and has ended."""

    session_id: str
    after: str | None


@dataclass(frozen=True, slots=True)
class TurnInputs:
    """What `start_turn` logged and read."""

    begun: bool  # the turn's start was logged (False: the job had ended)
    results: dict[str, dict[str, Any]]  # result records of the actions asked for, if recorded
    feed_changes: dict[str, dict[str, Any]]  # as `Store.feed_changes`
    conversation: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class TurnStart:
    """How turn `turn` starts, for a caller that knows how the last one closes without
    reading anything (no responses to render, no final response, no limit reached): `resume`
    then begins it in the same round trip, as `start_turn(closing=..., fields=...,
    begin=...)` would, reading the results of the native calls and of the finished actions
    (and logging `job_started` first, for turn 1)."""

    turn: int
    closing: Sequence[tuple[str, dict[str, Any]]]
    fields: Mapping[str, Any]
    begin: Sequence[tuple[str, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Resumed:
    """An agent turn that is due: begun now, or taken over (`restarted`)."""

    turn: int
    finished: list[str]  # actions that finished before it began
    restarted: bool
    job: JobRecord  # as it was once the turn was this caller's
    inputs: TurnInputs | None = None  # the turn's start, if `resume` began it (`TurnStart`)


def _turn_inputs(out: Sequence[Any], action_ids: Sequence[str]) -> TurnInputs:
    """What lua's begin_turn returned, for `action_ids`."""
    begun, results, changes, conversation = out
    return TurnInputs(
        begun=int(begun) != 0,
        results={a: json.loads(v) for a, v in zip(action_ids, results, strict=True)
                 if v is not None},
        feed_changes={k: json.loads(v) for k, v in zip(changes[::2], changes[1::2], strict=True)},
        conversation=[json.loads(m) for m in conversation])


class Store:
    """All reads and writes of job state go through here."""

    def __init__(self, client: redis.Redis, *, replica_acks: int = 1,
                 replica_wait_ms: int = 1000) -> None:
        self.redis = client
        self.replication = Replication(client, replica_acks, replica_wait_ms)
        self._scripts = {name: client.register_script(_lua(name))
                         for name in ("emit", "register", "claim", "finish", "retry", "close",
                                      "requeue", "resume", "turn_start", "turn_end", "turn_unwait",
                                      "turn_yield", "turn_renew",
                                      "begin", "redrive", "approval_request", "approval_decide")}
        self._tool_scripts = {name: client.register_script(_lua(name, prelude=False))
                              for name in ("slot_take", "slot_give", "model_take",
                                           "model_give", "model_answer", "tenant_lane",
                                           "tenant_admit")}

    @classmethod
    def from_url(cls, url: str, *, replica_acks: int = 1, replica_wait_ms: int = 1000) -> Store:
        # Ride out a Redis restart (or failover) of up to ~35 s: a command whose connection
        # fails is sent again after a backoff, instead of failing the task and losing the
        # result it was recording (redis-py's default gives up after well under a second).
        # A Sentinel URL's client asks the sentinels for the master again on each new
        # connection, so the retries also carry a command across a failover. A master that
        # froze with a command sent fails it after the read timeout, which is longer than
        # any wait a command asks of Redis (a write's WAIT): it too is sent again.
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), RECONNECT_RETRIES)
        return cls(sync_client(url, retry=retry, max_connections=MAX_CONNECTIONS,
                               pool_timeout=POOL_WAIT_S,
                               socket_timeout=READ_TIMEOUT_S + replica_wait_ms / 1000),
                   replica_acks=replica_acks, replica_wait_ms=replica_wait_ms)

    def _run(self, name: str, job_id: str, *args: Any, extra_keys: Sequence[str] = (),
             now: float | None = None, meanwhile: Callable[[], Any] | None = None) -> Any:
        """Run a job script once (its write id goes with every resend), and go on once the
        replicas have it (`replication`). `now`: the clock the script sees, if not the
        present. `meanwhile`: called once the script is on its way to Redis, before its reply
        is read (it is called in any case, once)."""
        keys = [*job_keys(job_id)[:SCRIPT_KEYS], *extra_keys]
        argv = [job_id, _clock(now), *args]
        if meanwhile is not None:
            return self._overlapped(name, keys, argv, meanwhile)
        return self._execute(name, keys, argv)

    def _execute(self, name: str, keys: Sequence[str], argv: Sequence[Any]) -> Any:
        script = self._scripts[name]
        acks = self.replication.acks()
        if not acks:
            return script(keys=keys, args=argv)
        with self.redis.pipeline(transaction=False) as pipe:
            for _ in range(2):  # the second time, with the script loaded (a new master)
                pipe.evalsha(script.sha, len(keys), *keys, *argv)
                pipe.wait(acks, self.replication.wait_ms)
                try:
                    out, acked = pipe.execute()
                    break
                except redis.exceptions.NoScriptError:
                    self.redis.script_load(script.script)
            else:
                raise redis.exceptions.NoScriptError(f"script {name} could not be loaded")
        self.replication.acked(int(acked), acks, name)
        return out

    def _overlapped(self, name: str, keys: Sequence[str], argv: Sequence[Any],
                    meanwhile: Callable[[], Any]) -> Any:
        """`_execute` with `meanwhile()` between sending the script and reading its reply.
        Anything unusual (the script not loaded on a new master, a broken connection) drops
        the connection and runs the script the usual way: with the same write id, a script
        that did run changes nothing the second time (lua/prelude.lua: `once`)."""
        script = self._scripts[name]
        acks = self.replication.acks()
        pool = self.redis.connection_pool
        connection: Any = None
        try:
            connection = pool.get_connection()
            connection.send_command("EVALSHA", script.sha, len(keys), *keys, *argv)
            if acks:
                connection.send_command("WAIT", acks, self.replication.wait_ms)
        except redis.exceptions.RedisError:
            if connection is not None:
                connection.disconnect()
                pool.release(connection)
            connection = None
        try:
            meanwhile()
        except BaseException:
            if connection is not None:  # its reply is never read: the connection cannot serve
                connection.disconnect()
                pool.release(connection)
            raise
        if connection is None:
            return self._execute(name, keys, argv)
        try:
            out = connection.read_response()
            acked = connection.read_response() if acks else None
        except redis.exceptions.RedisError:
            connection.disconnect()
            return self._execute(name, keys, argv)
        finally:
            pool.release(connection)
        if acks:
            self.replication.acked(int(acked), acks, name)
        return out

    def _barrier(self, what: str) -> None:
        """Go on once the replicas have every write made so far (a write's WAIT waits for
        the replication stream up to it, whoever made the earlier writes)."""
        acks = self.replication.acks()
        if not acks:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(REPLICATION_MARK, repr(time.time()))
            pipe.wait(acks, self.replication.wait_ms)
            acked = pipe.execute()[1]
        self.replication.acked(int(acked), acks, what)

    def _ttl(self, job_id: str) -> int:
        """The job's retention: its other keys expire with its record."""
        return int(self.redis.hget(job_keys(job_id).job, "ttl") or DEFAULT_TTL_S)

    # -- jobs -----------------------------------------------------------------------------
    def create_job(self, job_id: str, fields: dict[str, Any], ttl: int,
                   events: Sequence[tuple[str, dict[str, Any]]] = (), *,
                   session: SessionTurn | None = None, variables: dict[str, Any] | None = None,
                   conversation: Sequence[dict[str, Any]] = ()) -> JobRecord | None:
        """Create the job hash, index it, and append its first events, with its first
        variables and conversation, in one transaction; None once done. A job of this id that
        exists already is returned instead, and nothing is written (an id derived from what
        asked for the job: a redelivered action's child, a client's idempotency key). With
        `session`, the job's `input` and the job join the session in it too (SessionBusy if
        the session's last job is not `session.after`, or has not ended)."""
        keys = job_keys(job_id)
        key = keys.job
        now = time.time()
        emit = self._scripts["emit"]
        logged = not events
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    existing = pipe.hgetall(key)
                    if existing:
                        pipe.reset()
                        return JobRecord.from_hash(existing)
                    session_ttl = self._watch_session(pipe, session) if session else 0
                    pipe.multi()
                    pipe.hset(key, mapping=encode({
                        "id": job_id, "status": "queued", "created_at": now, "ttl": ttl,
                        "remaining": 0, "running": 0, "failures": 0, **fields}))
                    pipe.expire(key, ttl)
                    pipe.zadd(JOBS_INDEX, {job_id: now})
                    pipe.sadd(ACTIVE_JOBS, job_id)  # until `close` ends it
                    if fields.get("tenant"):
                        pipe.zadd(tenant_index(fields["tenant"]), {job_id: now})
                    if session:
                        message = {"role": "user", "content": fields["input"], "job_id": job_id}
                        self._session_append(pipe, session.session_id, session_ttl, message,
                                             job_id)
                    if variables:
                        pipe.hset(keys.vars, mapping={k: dumps(v) for k, v in variables.items()})
                    if conversation:
                        pipe.rpush(keys.conversation, *[dumps(m) for m in conversation])
                        pipe.expire(keys.conversation, ttl)
                    if events:  # by its digest: a script object would check it first, apart
                        pipe.evalsha(emit.sha, SCRIPT_KEYS, *job_keys(job_id)[:SCRIPT_KEYS],
                                     job_id, repr(now), "0", "", "",
                                     *_event_args(events))
                    pipe.execute()
                    logged = True
                    break
                except redis.WatchError:  # another request made the job, or the session moved
                    continue  # on: the next pass says which
                except redis.exceptions.NoScriptError:  # Redis lost its scripts (a restart):
                    break  # the rest of the transaction ran; the events go the usual way
        if not logged:
            self.emit(job_id, events)
        else:
            self._barrier("create_job")  # a job the API answered 201 for outlives a failover
        return None

    @staticmethod
    def _watch_session(pipe: Any, turn: SessionTurn) -> int:
        """Watch the session's jobs and its last job; raise SessionBusy unless the last job
        is `turn.after` and has ended (or expired). Returns the session's retention."""
        key = session_key(turn.session_id)
        pipe.watch(f"{key}:jobs")
        last = pipe.lindex(f"{key}:jobs", -1)
        if last != turn.after:
            raise SessionBusy(f"another message to session {turn.session_id!r} started job "
                              f"{last!r} first; read the session again", last)
        if last is not None:
            pipe.watch(job_keys(last).job)
            status = pipe.hget(job_keys(last).job, "status")
            if status is not None and status not in JOB_TERMINAL:
                raise SessionBusy(f"the session's job {last!r} is still running; wait for it "
                                  "to end (or cancel it) before sending another message", last)
        return int(pipe.hget(key, "ttl") or DEFAULT_TTL_S)

    def set_job(self, job_id: str, **fields: Any) -> None:
        """Change fields of the job record (typed as in `JobRecord`)."""
        self.redis.hset(job_keys(job_id).job, mapping=encode(fields))

    def get_job(self, job_id: str) -> JobRecord | None:
        data = self.redis.hgetall(job_keys(job_id).job)
        return JobRecord.from_hash(data) if data else None

    def peek(self, job_id: str, *fields: str) -> JobRecord | None:
        """Only some fields of the job record (the others keep their defaults); None if the
        job does not exist. Cheap: a document job's record holds the whole document."""
        return self.peek_many([job_id], *fields)[0]

    def peek_many(self, job_ids: Sequence[str], *fields: str) -> list[JobRecord | None]:
        """`peek` for several jobs, in one round trip."""
        names = ["id", *fields]
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(job_keys(job_id).job, names)
        return [JobRecord.from_hash({k: v for k, v in zip(names, values, strict=True)
                                     if v is not None}) if values[0] is not None else None
                for values in pipe.execute()]

    def list_jobs(self, limit: int = 50, offset: int = 0, tenant: str | None = None) -> list[str]:
        """Job ids, newest first: every job, or (`tenant`) only that tenant's."""
        index = JOBS_INDEX if tenant is None else tenant_index(tenant)
        return self.redis.zrevrange(index, offset, offset + limit - 1)

    def actions(self, job_id: str) -> dict[str, dict[str, Any]]:
        """Every action of the job: its spec, status and result record."""
        keys = job_keys(job_id)
        pipe = self.redis.pipeline()
        pipe.hgetall(keys.spec)
        pipe.hgetall(keys.status)
        pipe.hgetall(keys.result)
        pipe.hgetall(keys.attempts)
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
        key = job_keys(job_id).children
        pipe = self.redis.pipeline()
        pipe.sadd(key, child_id)
        pipe.expire(key, self._ttl(job_id))
        pipe.execute()

    def children(self, job_id: str) -> set[str]:
        return self.redis.smembers(job_keys(job_id).children)

    def action_statuses(self, job_id: str) -> dict[str, str]:
        """Action id -> status, for every registered action."""
        return self.redis.hgetall(job_keys(job_id).status)

    def action_status(self, job_id: str, action_id: str) -> str | None:
        return self.redis.hget(job_keys(job_id).status, action_id)

    def ids_with_status(self, job_id: str, status: str) -> set[str]:
        return {a for a, st in self.action_statuses(job_id).items() if st == status}

    def spec(self, job_id: str, action_id: str) -> dict[str, Any] | None:
        raw = self.redis.hget(job_keys(job_id).spec, action_id)
        return json.loads(raw) if raw else None

    def variables(self, job_id: str, names: Iterable[str]) -> dict[str, Any]:
        names = list(names)
        if not names:
            return {}
        values = self.redis.hmget(job_keys(job_id).vars, names)
        return {n: json.loads(v) for n, v in zip(names, values, strict=True) if v is not None}

    def variable_names(self, job_id: str) -> list[str]:
        return sorted(self.redis.hkeys(job_keys(job_id).vars))

    def set_variables(self, job_id: str, values: dict[str, Any]) -> None:
        if values:
            self.redis.hset(job_keys(job_id).vars, mapping={k: dumps(v) for k, v in values.items()})

    def delete_variable(self, job_id: str, name: str) -> bool:
        """Forget a variable; False if it was not set."""
        return bool(self.redis.hdel(job_keys(job_id).vars, name))

    # -- context feeds ----------------------------------------------------------------------
    def feed_changes(self, job_id: str) -> dict[str, dict[str, Any]]:
        """The job's run-time feed changes, by feed id (see `feeds.save_feed`)."""
        return {k: json.loads(v) for k, v in self.redis.hgetall(job_keys(job_id).feeds).items()}

    def feed_change(self, job_id: str, feed_id: str) -> dict[str, Any] | None:
        raw = self.redis.hget(job_keys(job_id).feeds, feed_id)
        return json.loads(raw) if raw else None

    def set_feed_change(self, job_id: str, feed_id: str, change: dict[str, Any]) -> None:
        key = job_keys(job_id).feeds
        pipe = self.redis.pipeline()
        pipe.hset(key, feed_id, dumps(change))
        pipe.expire(key, self._ttl(job_id))
        pipe.execute()

    def cached(self, key: str) -> Any:
        """A value of the shared cache (`keys.feed_cache_key`), or None."""
        raw = self.redis.get(key)
        return None if raw is None else json.loads(raw)

    def cache(self, key: str, value: Any, ttl_s: float) -> None:
        self.redis.set(key, dumps(value), px=max(1, round(ttl_s * 1000)))

    # -- recovery (see reconciler.py) -------------------------------------------------------
    def active_jobs(self) -> list[str]:
        """Ids of the jobs that have not ended."""
        return list(self.redis.sscan_iter(ACTIVE_JOBS, count=1000))

    def forget_active(self, job_id: str) -> None:
        """Drop a job that has ended or expired from the active set."""
        self.redis.srem(ACTIVE_JOBS, job_id)

    def action_states(self, job_ids: Sequence[str]) -> list[dict[str, ActionState]]:
        """Each job's unfinished actions: status, lease, when it was queued and how many times
        it was sent again (what the reconciler needs), for every job in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            keys = job_keys(job_id)
            for key in (keys.status, keys.lease, keys.timings, keys.redrives):
                pipe.hgetall(key)
        replies = pipe.execute()
        return [_action_states(*replies[at:at + 4]) for at in range(0, len(replies), 4)]

    def redrive(self, job_id: str, action_id: str, dead_owner: str, why: str,
                most: int) -> tuple[str, Any]:
        """Send a lost action again: ("send", spec), ("give_up", times) past `most` times, or
        ("", None) if it needs nothing (see lua/redrive.lua)."""
        out = self._run("redrive", job_id, action_id, dead_owner, why, str(most),
                        extra_keys=[job_keys(job_id).redrives])
        if not out:
            return "", None
        return ("send", json.loads(out[1])) if out[0] == "send" else ("give_up", int(out[1]))

    def request_approval(self, job_id: str, action_id: str, record: dict[str, Any],
                         event: dict[str, Any]) -> str:
        """Hold a ready action for approval (see lua/approval_request.lua): 'new', or the
        state that stood in the way."""
        return str(self._run("approval_request", job_id, action_id, dumps(record), dumps(event),
                             extra_keys=[job_keys(job_id).approvals]))

    def decide_approval(self, job_id: str, action_id: str, decision: str,
                        event: dict[str, Any]) -> str:
        """Answer an approval request once (see lua/approval_decide.lua)."""
        return str(self._run("approval_decide", job_id, action_id, decision, dumps(event),
                             extra_keys=[job_keys(job_id).approvals]))

    def approvals(self, job_id: str) -> dict[str, dict[str, Any]]:
        """The job's approval records, by action id."""
        raw = self.redis.hgetall(job_keys(job_id).approvals)
        return {action_id: json.loads(record) for action_id, record in raw.items()}

    def redrives(self, job_id: str, what: str) -> int:
        """How many times `what` (an action id, or "@start" and the like) was sent again."""
        return int(self.redis.hget(job_keys(job_id).redrives, what) or 0)

    def count_redrive(self, job_id: str, what: str) -> int:
        key = job_keys(job_id).redrives
        pipe = self.redis.pipeline()
        pipe.hincrby(key, what, 1)
        pipe.expire(key, self._ttl(job_id))
        return int(pipe.execute()[0])

    def hand_over(self, job_id: str, action_id: str, holder: str) -> None:
        """Give a running action's lease to `holder` (a child job), keeping its expiry."""
        key = job_keys(job_id).lease
        lease = self.redis.hget(key, action_id)
        if lease is not None:
            self.redis.hset(key, action_id, f"{holder}|{lease.rpartition('|')[2]}")

    # -- tools with max_concurrency -----------------------------------------------------------
    def take_slot(self, gate: str, holder: str, limit: int, lease_s: float,
                  waiting: dict[str, Any] | None) -> bool:
        """Take one of the gate's `limit` slots (`keys.slot_keys`) for `holder` (for `lease_s`
        seconds); if none is free, put `waiting` in line (sent again when a slot frees) and
        return False."""
        now = time.time()
        return bool(self._tool_scripts["slot_take"](keys=list(slot_keys(gate)), args=[
            holder, repr(now), repr(now + lease_s), limit, dumps(waiting) if waiting else ""]))

    def give_slot(self, gate: str, holder: str, limit: int) -> list[dict[str, Any]]:
        """Give back `holder`'s slot; returns the waiting calls to send now."""
        out = self._tool_scripts["slot_give"](keys=list(slot_keys(gate)),
                                              args=[holder, repr(time.time()), limit])
        return [json.loads(entry) for entry in out]

    def slots_in_use(self, gate: str) -> int:
        key = slot_keys(gate)[0]
        self.redis.zremrangebyscore(key, "-inf", time.time())
        return int(self.redis.zcard(key))

    def throttle(self, job_id: str, action_id: str) -> None:
        """Mark a queued action as waiting for a tool slot (claiming it clears the mark)."""
        self.redis.hset(job_keys(job_id).timings, f"w|{action_id}", repr(time.time()))

    def wait_for_model(self, job_id: str, action_id: str, until: float) -> None:
        """Mark a queued action as held in its queue until `until` (time.time()), when its
        model endpoint's known wait ends and its message comes back (claiming it clears the
        mark): its message is not lost meanwhile."""
        self.redis.hset(job_keys(job_id).timings, f"m|{action_id}", repr(until))

    # -- model endpoints' shared limits (llm/limits.py) ----------------------------------------
    def take_model_slot(self, endpoint: str, holder: str, tenant: str, *, lease_s: float,
                        limits: Sequence[float | None], tokens: int,
                        stale_s: float) -> tuple[bool, float | None, str, int]:
        """Take a request slot of `endpoint` for `holder`, or stand in line for one. `limits`:
        requests per minute, tokens per minute, max concurrent (None: not declared). Returns
        (taken, seconds to wait or None if unknown, why it must wait, the request's number
        among the endpoint's: 0 if not taken)."""
        now = time.time()
        out = self._tool_scripts["model_take"](keys=list(model_keys(endpoint)), args=[
            holder, tenant, repr(now), repr(now + lease_s),
            *("" if limit is None else limit for limit in limits), tokens, stale_s])
        if int(out[0]) == 1:
            return True, None, "", int(out[2])
        wait_ms = int(out[1])
        return False, (None if wait_ms < 0 else wait_ms / 1000), str(out[2]), 0

    def give_model_slot(self, endpoint: str, holder: str, *, taken: int, used: int | None,
                        tokens_per_minute: int | None, answered: bool = False,
                        ceiling: int = 64) -> None:
        """Give back `holder`'s slot of `endpoint`, with the tokens its request was counted
        for (`taken`) corrected to those it `used`; an `answered` request grows the adaptive
        limit back towards `ceiling` (lua/model_give.lua)."""
        self._tool_scripts["model_give"](keys=list(model_keys(endpoint)), args=[
            holder, taken, "" if used is None else used,
            "" if tokens_per_minute is None else tokens_per_minute, 1 if answered else 0,
            ceiling])

    def model_answer(self, endpoint: str, *, refused: bool, reset_s: float | None,
                     remaining: int | None, number: int = 0) -> float:
        """What an answer's head said about `endpoint`'s limits (lua/model_answer.lua): a
        refusal's pause, the provider's remaining count; returns the seconds of the pause now
        in force (0: none)."""
        def arg(value: float | None) -> str:
            return "" if value is None else repr(value)
        out = self._tool_scripts["model_answer"](keys=list(model_keys(endpoint)), args=[
            repr(time.time()), 1 if refused else 0, arg(reset_s), arg(remaining), number])
        return int(out) / 1000

    def leave_model_line(self, endpoint: str, holder: str) -> None:
        """`holder` no longer waits for a slot of `endpoint` (it gave up or was cancelled)."""
        keys = model_keys(endpoint)
        pipe = self.redis.pipeline()
        pipe.zrem(keys.waiting, holder)
        pipe.hdel(keys.waiters, holder)
        pipe.execute()

    def model_known_wait(self, endpoint: str) -> tuple[str, float] | None:
        """The wait every request to `endpoint` has now, if one is known, as lua/model_take.lua
        reads it: ('paused', seconds) after a refusal, ('remaining', seconds) while the
        provider's count is spent until its reset; None if neither."""
        pause, budget, reset = self.redis.hmget(model_keys(endpoint).state, "pause_until",
                                                "budget", "budget_reset")
        now = time.time()
        if pause is not None and float(pause) > now:
            return "paused", float(pause) - now
        if budget is not None and float(budget) <= 0 and reset is not None and float(reset) > now:
            return "remaining", float(reset) - now
        return None

    def model_use(self, endpoint: str) -> dict[str, Any]:
        """What `endpoint` uses now: requests in flight and waiting, the pause in force, the
        adaptive concurrency limit, and the requests and 429s counted so far."""
        keys, now = model_keys(endpoint), time.time()
        pipe = self.redis.pipeline()
        pipe.zcount(keys.inflight, now, "+inf")
        pipe.zcard(keys.waiting)
        pipe.hmget(keys.state, "pause_until", "cap", "requests", "refused", "waits")
        in_flight, waiting, (pause, cap, requests, refused, waits) = pipe.execute()
        return {"in_flight": int(in_flight), "waiting": int(waiting),
                "paused_for_s": round(max(0.0, float(pause or 0) - now), 3),
                "adaptive_max_concurrent": None if cap is None else int(float(cap)),
                "requests": int(requests or 0), "rate_limited": int(refused or 0),
                "waits": int(waits or 0)}

    def tenant_lane(self, tenant: str, lanes: int) -> int:
        """The lane of each pool's queue `tenant`'s work goes to (lua/tenant_lane.lua: given
        once, to the lane with the fewest tenants)."""
        return int(self._tool_scripts["tenant_lane"](keys=[TENANT_LANES], args=[tenant, lanes]))

    # -- usage (jobs/usage.py) ----------------------------------------------------------------
    def record_usage(self, job_id: str, tenant: str, endpoint: str, *, prompt_tokens: int,
                     completion_tokens: int, days: Sequence[str], ttl_s: int) -> None:
        """Count one answered model request against the job and its tenant's `days` keys (its
        UTC day and month: `usage_key`)."""
        counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "requests": 1}
        pipe = self.redis.pipeline(transaction=False)
        for key in (job_keys(job_id).usage, *(usage_key(tenant, d) for d in days)):
            for name, value in counts.items():
                if value:
                    pipe.hincrby(key, f"{endpoint}|{name}", value)
            if key != job_keys(job_id).usage:
                pipe.hincrby(key, "tokens", prompt_tokens + completion_tokens)
                pipe.expire(key, ttl_s)
        pipe.expire(job_keys(job_id).usage, self._ttl(job_id))
        pipe.execute()

    def usage(self, key: str) -> dict[str, dict[str, int]]:
        """A usage hash as {endpoint: {prompt_tokens, completion_tokens, requests}}."""
        out: dict[str, dict[str, int]] = {}
        for field, value in self.redis.hgetall(key).items():
            endpoint, _, name = field.rpartition("|")
            if endpoint:
                out.setdefault(endpoint, {"prompt_tokens": 0, "completion_tokens": 0,
                                          "requests": 0})[name] = int(value)
        return out

    def tokens_used(self, tenant: str, periods: Sequence[str]) -> list[int]:
        """The tokens `tenant` used in each of `periods` (days or months)."""
        pipe = self.redis.pipeline(transaction=False)
        for period in periods:
            pipe.hget(usage_key(tenant, period), "tokens")
        return [int(v or 0) for v in pipe.execute()]

    # -- tenants' caps (jobs/tenants.py) -------------------------------------------------------
    def admit_running(self, tenant: str, job_id: str, cap: int) -> bool:
        """Admit `job_id` among `tenant`'s running jobs if fewer than `cap` are (or it is)."""
        return bool(self._tool_scripts["tenant_admit"](keys=[tenant_running_key(tenant)],
                                                       args=[job_id, cap]))

    def release_running(self, tenant: str, job_id: str) -> None:
        self.redis.srem(tenant_running_key(tenant), job_id)

    def prune_running(self, tenant: str) -> int:
        """Release the admitted jobs of `tenant` that have ended (their release was lost);
        returns how many."""
        key = tenant_running_key(tenant)
        members = sorted(self.redis.smembers(key))
        pipe = self.redis.pipeline(transaction=False)
        for job_id in members:
            pipe.hget(job_keys(job_id).job, "status")
        gone = [j for j, st in zip(members, pipe.execute(), strict=True)
                if st is None or st in JOB_TERMINAL]
        if gone:
            self.redis.srem(key, *gone)
        return len(gone)

    def note_model_endpoint(self, endpoint: str) -> None:
        """List `endpoint` among those whose limits are kept (`model_endpoints`)."""
        self.redis.sadd(MODELS_INDEX, endpoint)

    def model_endpoints(self) -> list[str]:
        return sorted(self.redis.smembers(MODELS_INDEX))

    def count_model_wait(self, endpoint: str) -> None:
        self.redis.hincrby(model_keys(endpoint).state, "waits", 1)

    def beat(self, owner: str, ttl_s: float) -> None:
        """Say that worker process `owner` is alive for the next `ttl_s` seconds."""
        self.redis.set(alive_key(owner), "1", px=max(1, round(ttl_s * 1000)))

    def alive(self, owners: Iterable[str]) -> set[str]:
        """Those of `owners` whose heartbeat has not expired."""
        owners = list(owners)
        if not owners:
            return set()
        flags = self.redis.mget([alive_key(o) for o in owners])
        return {o for o, flag in zip(owners, flags, strict=True) if flag is not None}

    def try_lock(self, key: str, owner: str, ttl_s: float) -> bool:
        """Take `key` for `ttl_s` seconds unless another owner holds it."""
        return bool(self.redis.set(key, owner, nx=True, px=max(1, round(ttl_s * 1000))))

    # -- sessions -------------------------------------------------------------------------
    def create_session(self, session_id: str, agent: str, options: dict[str, Any], ttl: int,
                       tenant: str = DEFAULT_TENANT) -> None:
        key = session_key(session_id)
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping={"id": session_id, "agent": agent, "created_at": repr(time.time()),
                                "options": dumps(options), "ttl": str(ttl), "tenant": tenant})
        pipe.expire(key, ttl)
        pipe.execute()

    def get_session(self, session_id: str) -> dict[str, Any] | None:
        key = session_key(session_id)
        pipe = self.redis.pipeline()
        pipe.hgetall(key)
        pipe.lrange(f"{key}:messages", 0, -1)
        pipe.lrange(f"{key}:jobs", 0, -1)
        data, messages, jobs = pipe.execute()
        if not data:
            return None
        return {**data, "messages": [json.loads(m) for m in messages], "jobs": jobs}

    def append_session(self, session_id: str, message: dict[str, Any]) -> None:
        """Add a message to the session (a job's reply)."""
        ttl = int(self.redis.hget(session_key(session_id), "ttl") or DEFAULT_TTL_S)
        pipe = self.redis.pipeline()
        self._session_append(pipe, session_id, ttl, message)
        pipe.execute()

    @staticmethod
    def _session_append(pipe: Any, session_id: str, ttl: int, message: dict[str, Any],
                        job_id: str | None = None) -> None:
        key = session_key(session_id)
        pipe.rpush(f"{key}:messages", dumps(message))
        if job_id is not None:
            pipe.rpush(f"{key}:jobs", job_id)
        for suffix in ("", ":messages", ":jobs"):
            pipe.expire(key + suffix, ttl)

    # -- events ---------------------------------------------------------------------------
    def emit(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]], *,
             live: bool = False, fence: int | None = None, streamed: str = "") -> int:
        """Append events to the job's log; returns the last seq. `live`: only if the job has
        not ended (0 is returned then): a turn's output never follows `job_cancelled`.
        `fence`: the writing turn's; Fenced if it is stale. `streamed`: the model's text these
        events came from, kept as the turn's partial answer (`partial`)."""
        args = _event_args(events)
        if not args and not streamed:
            return 0
        seq = int(self._run("emit", job_id, "1" if live else "0", _fence(fence), streamed,
                            *args))
        if seq < 0:
            raise Fenced("events", job_id, f"turn fence {fence}")
        return seq

    def emit_many(self, batches: Mapping[tuple[str, int | None],
                                         Sequence[tuple[str, dict[str, Any]]]], *,
                  live: bool = False, streamed: Mapping[tuple[str, int | None], str] | None = None
                  ) -> list[tuple[str, int | None]]:
        """`emit` for several jobs in one round trip (a pipeline; each job's events atomic),
        keyed by (job id, the writing turn's fence), with `streamed` text by the same keys;
        returns the keys whose fence was stale (nothing of theirs was written)."""
        pipe = self.redis.pipeline(transaction=False)
        now = repr(time.time())
        sent: list[tuple[str, int | None]] = []
        for key in {**batches, **(streamed or {})}:
            job_id, fence = key
            args = _event_args(batches.get(key, ()))
            text = (streamed or {}).get(key, "")
            if args or text:
                self._scripts["emit"](keys=job_keys(job_id)[:SCRIPT_KEYS], client=pipe,
                                      args=[job_id, f"{now}|{os.urandom(8).hex()}",
                                            "1" if live else "0", _fence(fence), text, *args])
                sent.append((job_id, fence))
        acks = self.replication.acks() if sent else 0
        if acks:
            pipe.wait(acks, self.replication.wait_ms)
        out = pipe.execute()
        if acks:
            self.replication.acked(int(out.pop()), acks, "emit")
        return [key for key, seq in zip(sent, out, strict=True) if int(seq) < 0]

    def events_after(self, job_id: str, after: int = 0, count: int | None = None) -> list[dict[str, Any]]:
        """Events with seq > `after`, in order."""
        entries = self.redis.xrange(job_keys(job_id).events, min=f"{after + 1}-0", count=count)
        return [json.loads(fields["e"]) for _, fields in entries]

    # -- actions --------------------------------------------------------------------------
    def begin(self, job_id: str, events: Sequence[tuple[str, dict[str, Any]]]) -> str:
        """Start a queued document or workflow job and log `events`: "started", "running"
        (it had begun: a redelivered start) or "ended" (cancelled before it began)."""
        return str(self._run("begin", job_id, *_event_args(events)))

    def register(self, job_id: str, actions: Sequence[dict[str, Any]], *, close: bool,
                 fence: int | None = None) -> Dispatch:
        """Add actions (`id, spec, deps, after, on_error`) to the job; return those ready now.
        Nothing is registered once the job has ended (`recorded` is then False). `fence`:
        the registering turn's; Fenced if it is stale."""
        out = self._run("register", job_id, dumps(list(actions)), "1" if close else "0",
                        _fence(fence))
        if out == ["ended"]:
            return Dispatch(ready=[], drained=False, recorded=False)
        if out == ["stale"]:
            raise Fenced("registration", job_id, f"turn fence {fence}")
        bar = out.index("|")
        return Dispatch(ready=[{"id": i} for i in out[:bar]], drained=bool(int(out[bar + 1])))

    def claim(self, job_id: str, action_id: str, owner: str, lease_s: float,
              names: Sequence[str] = (), *, force: bool = False, ahead: bool = False,
              foresee: int = 0) -> list[Any]:
        """Take the action's lease: `["run", attempt, value of each of `names`..., spec of each
        foreseen dependent...]`, or `["done"]`, `["stop"]`, `["blocked"]`, `["busy", holder,
        expiry]`. `force`: take over a lease. `ahead`: the message was sent ahead of its
        dependencies' finish (a `blocked` one has that finish send it again). `foresee`: at
        most this many dependents that this action's success alone makes ready (lua/claim.lua),
        whose messages may go out ahead of its finish."""
        return self._run("claim", job_id, action_id, owner, repr(lease_s), "1" if force else "0",
                         "1" if ahead else "0", str(foresee), *names)

    def finish(self, job_id: str, action_id: str, status: str, record: dict[str, Any],
               value: Any, output_key: str | None, event: tuple[str, dict[str, Any]], *,
               attempt: int | None = None, holder: str = "", fence: int | None = None,
               ahead: Sequence[str] = (), send_ahead: Callable[[], Any] | None = None,
               now: float | None = None) -> Dispatch:
        """Record an action's end once and walk its dependents. `attempt` (held by `holder`)
        or the recording turn's `fence`: Fenced if it is no longer current. `ahead`: the
        dependents whose messages `send_ahead()` sends, once this finish is on its way to
        Redis (a message that still comes before it is sent again: none is in `ready`
        otherwise). `now`: when the action's end was known (its events' time)."""
        out = self._run("finish", job_id, action_id, status, dumps(record), dumps(value),
                        output_key or "", event[0], dumps(event[1]), _fence(attempt), holder,
                        _fence(fence), "\n".join(ahead), now=now, meanwhile=send_ahead)
        if out == ["stale"]:
            raise Fenced(f"result of action {action_id}", job_id,
                         f"attempt {attempt}" if attempt is not None else f"turn fence {fence}")
        return Dispatch(ready=[json.loads(x) for x in out[2:]], drained=bool(int(out[1])),
                        recorded=bool(int(out[0])))

    def current_attempts(self, actions: Sequence[tuple[str, str]], holder: str
                         ) -> list[int | None]:
        """For each (job id, action id), its current attempt if `holder` holds its lease and
        its job has not failed or been cancelled (it may still run), else None: one round
        trip (recovery/fencing.py checks the attempts a process runs)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, action_id in actions:
            keys = job_keys(job_id)
            pipe.hget(keys.job, "status")
            pipe.hget(keys.attempts, action_id)
            pipe.hget(keys.lease, action_id)
        out = pipe.execute()
        current: list[int | None] = []
        for status, attempt, lease in zip(out[::3], out[1::3], out[2::3], strict=True):
            live = status not in (None, "failed", "cancelled")
            held = lease is not None and lease.rpartition("|")[0] == holder
            current.append(int(attempt) if live and held and attempt else None)
        return current

    def queued_dependents(self, job_id: str, action_id: str) -> list[dict[str, Any]]:
        """Specs of dependents marked queued: to send again after a worker died mid-dispatch."""
        return [json.loads(x) for x in self._run("requeue", job_id, action_id)]

    def resume(self, job_id: str, owner: str = "", lease_s: float = 30.0,
               dead_owner: str = "", start: TurnStart | None = None) -> Resumed | None:
        """Begin an agent's next turn as `owner`, or take over the turn in progress if its
        owner is `dead_owner` or its lease expired (see lua/resume.lua); None if no turn is
        due. The job record comes in the same round trip, and with `start` the turn's start
        too (`Resumed.inputs`) if the job agrees (else the caller starts it)."""
        keys = job_keys(job_id)
        starting: list[str] = []
        if start is not None:
            closing = _event_args(start.closing)
            starting = [str(start.turn), dumps(encode(dict(start.fields))), str(len(closing)),
                        *closing, *_event_args(start.begin)]
        out = self._run("resume", job_id, owner, repr(lease_s), dead_owner, *starting,
                        extra_keys=(keys.conversation, keys.feeds))
        if not int(out[0]):
            return None
        n = int(out[2])
        finished = list(out[3:3 + n])
        m = int(out[3 + n])
        record = out[4 + n:4 + n + m]
        job = JobRecord.from_hash(dict(zip(record[::2], record[1::2], strict=True)))
        begun = out[4 + n + m]
        inputs = None
        if begun != 0:
            asked = [c["action_id"] for c in job.native_calls] + finished
            inputs = _turn_inputs(begun, asked)
        return Resumed(int(out[0]), finished, bool(int(out[1])), job, inputs)

    def start_turn(self, job_id: str, *, closing: Sequence[tuple[str, dict[str, Any]]] = (),
                   fields: Mapping[str, Any] | None = None,
                   begin: Sequence[tuple[str, dict[str, Any]]] = (),
                   action_ids: Sequence[str] | None = (), fence: int | None = None) -> TurnInputs:
        """A turn's start in one round trip (lua/turn_start.lua): log `closing` (the last
        turn's end), set `fields` of the job record, log `begin` unless the job has ended, and
        read the results of `action_ids`, the feed changes and the conversation (nothing if
        `action_ids` is None: the job ends instead of starting a turn). Fenced if the turn's
        `fence` is stale."""
        keys = job_keys(job_id)
        closing_args = _event_args(closing)
        out = self._run("turn_start", job_id, dumps(encode(dict(fields or {}))),
                        dumps(None if action_ids is None else list(action_ids)), _fence(fence),
                        str(len(closing_args)), *closing_args, *_event_args(begin),
                        extra_keys=(keys.conversation, keys.feeds))
        if out == ["stale"]:
            raise Fenced("turn start", job_id, f"turn fence {fence}")
        if action_ids is None:
            return TurnInputs(begun=int(out[0]) != 0, results={}, feed_changes={},
                              conversation=[])
        return _turn_inputs(out, list(action_ids))

    def end_turn(self, job_id: str, messages: Sequence[dict[str, Any]], fields: Mapping[str, Any],
                 events: Sequence[tuple[str, dict[str, Any]]] = (), *, waiter: str = "",
                 chunks: Sequence[tuple[str, dict[str, Any]]] = (),
                 fence: int | None = None) -> bool:
        """A turn's end in one round trip (lua/turn_end.lua): log the turn's last `chunks`
        (unless the job has ended), append `messages` to the conversation, log `events`, set
        `fields`, close the turn's plan; True if the job drained (its next turn is due now).
        If not, and `waiter` (host:pid) is given, its drain is published to that process
        instead of being left to whoever drains it. Fenced (nothing written) if the turn's
        `fence` is stale."""
        chunk_args = _event_args(chunks)
        out = int(self._run("turn_end", job_id, dumps(encode(dict(fields))), waiter,
                            _fence(fence), str(len(messages)), *[dumps(m) for m in messages],
                            str(len(chunk_args)), *chunk_args, *_event_args(events),
                            extra_keys=(job_keys(job_id).conversation,)))
        if out < 0:
            raise Fenced("turn end", job_id, f"turn fence {fence}")
        return bool(out)

    def unwait(self, job_id: str, waiter: str) -> bool:
        """`waiter` stops waiting in place for the job to drain (lua/turn_unwait.lua): True if
        the drain was handed to it already (it takes the next turn)."""
        return bool(int(self._run("turn_unwait", job_id, waiter)))

    def yield_turn(self, job_id: str, owner: str, fence: int | None = None) -> bool:
        """`owner` hands the job's turn back before its stream opened (lua/turn_yield.lua):
        True if it was its turn (of `fence`) to hand back."""
        return bool(int(self._run("turn_yield", job_id, owner, _fence(fence))))

    def renew_turn(self, job_id: str, fence: int | None, lease_s: float) -> bool:
        """Extend the turn's lease by `lease_s` from now; False if the job has ended or the
        turn is no longer `fence`'s (lua/turn_renew.lua)."""
        return bool(int(self._run("turn_renew", job_id, _fence(fence),
                                  repr(time.time() + lease_s))))

    def results(self, job_id: str, action_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Result records of the given actions (those recorded)."""
        if not action_ids:
            return {}
        values = self.redis.hmget(job_keys(job_id).result, list(action_ids))
        return {a: json.loads(v) for a, v in zip(action_ids, values, strict=True) if v is not None}

    def partial(self, job_id: str) -> str:
        """The text the job's turn in progress has streamed so far (kept for a model that can
        continue it: `ModelConfig.continuation`)."""
        return self.redis.get(job_keys(job_id).partial) or ""

    def conversation(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.redis.lrange(job_keys(job_id).conversation, 0, -1)]

    def append_conversation(self, job_id: str, *messages: dict[str, Any]) -> None:
        key = job_keys(job_id).conversation
        pipe = self.redis.pipeline()
        pipe.rpush(key, *[dumps(m) for m in messages])
        pipe.expire(key, self._ttl(job_id))
        pipe.execute()

    def clear_conversation(self, job_id: str) -> int:
        """Forget an agent's conversation; returns how many messages it held."""
        key = job_keys(job_id).conversation
        pipe = self.redis.pipeline()
        pipe.llen(key)
        pipe.delete(key)
        return int(pipe.execute()[0])

    def retry(self, job_id: str, action_id: str, data: dict[str, Any], *,
              attempt: int | None = None, holder: str = "") -> bool:
        """Send the action again after `attempt` (held by `holder`) failed; False if it is not
        to run again. Fenced if the attempt is no longer current."""
        out = int(self._run("retry", job_id, action_id, dumps(data), _fence(attempt), holder))
        if out < 0:
            raise Fenced(f"retry of action {action_id}", job_id, f"attempt {attempt}")
        return bool(out)

    def close(self, job_id: str, status: str, fields: dict[str, Any] | None = None,
              events: Sequence[tuple[str, dict[str, Any]]] = (), *, only_if: str = "",
              fence: int | None = None) -> list[str] | None:
        """End the job with `status`; unfinished actions are cancelled; the last event (its
        end) carries the job's model usage, if it has any. None if it had ended (or the
        ending turn's `fence` is stale)."""
        args = _event_args(events)
        out = self._run("close", job_id, status, dumps(encode(fields or {})), only_if,
                        _fence(fence), *args,
                        extra_keys=[job_keys(job_id).usage])
        return None if out is None else list(out)

    # -- AG-UI runs (cortex_api/routes/agui.py) -------------------------------------------
    def agui_runs(self, session_id: str) -> dict[str, dict[str, Any]]:
        """A session's AG-UI runs: run id -> `{job, after, until, at}` (`agui_runs_key`)."""
        raw = self.redis.hgetall(agui_runs_key(session_id))
        return {run: json.loads(value) for run, value in raw.items()}

    def claim_agui_run(self, session_id: str, run_id: str, record: dict[str, Any]) -> bool:
        """Record a new run; False if the id is taken (a run is started once, whoever posts
        it again attaches to it). The runs expire with their session."""
        key = agui_runs_key(session_id)
        ttl = int(self.redis.hget(session_key(session_id), "ttl") or DEFAULT_TTL_S)
        pipe = self.redis.pipeline()
        pipe.hsetnx(key, run_id, dumps(record))
        pipe.expire(key, ttl)
        return bool(pipe.execute()[0])

    def settle_agui_run(self, session_id: str, run_id: str, **fields: Any) -> dict[str, Any] | None:
        """Fill the fields of a run's record that are still unset (each is written once: two
        streams that see the run end agree on where); returns the record, None if unknown."""
        key = agui_runs_key(session_id)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, run_id)
                    if raw is None:
                        return None
                    record = json.loads(raw)
                    new = {k: v for k, v in fields.items() if record.get(k) is None}
                    if not new:
                        return record
                    record.update(new)
                    pipe.multi()
                    pipe.hset(key, run_id, dumps(record))
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue

    def drop_agui_run(self, session_id: str, run_id: str) -> None:
        """Forget a run whose job could not be started (its id may be posted again)."""
        self.redis.hdel(agui_runs_key(session_id), run_id)

    def waiting_for_people(self, job_id: str) -> int | None:
        """The job's last seq if it now waits only for a person: running, its turn generated,
        no action queued, running or parked, and one awaiting approval; else None. One
        snapshot (MULTI), so the seq is where the wait began."""
        keys = job_keys(job_id)
        pipe = self.redis.pipeline()
        pipe.hmget(keys.job, ["status", "turn_phase"])
        pipe.hvals(keys.status)
        pipe.get(keys.seq)
        (status, phase), statuses, seq = pipe.execute()
        busy = {ActionStatus.queued, ActionStatus.running, ActionStatus.waiting}
        if status != JobStatus.running or phase != "generated" \
                or ActionStatus.awaiting_approval not in statuses or busy.intersection(statuses):
            return None
        return int(seq or 0)

    # -- remote A2A tasks (agents/remote.py) --------------------------------------------
    def remote_task(self, job_id: str, action_id: str) -> dict[str, Any] | None:
        """The remote task an action's call started (`remote_tasks_key`), None if none yet."""
        raw = self.redis.hget(remote_tasks_key(job_id), action_id)
        return None if raw is None else json.loads(raw)

    def record_remote_task(self, job_id: str, action_id: str,
                           record: dict[str, Any]) -> dict[str, Any]:
        """Record the remote task an action's call started, once, kept as long as the job's
        keys and on the replicas before this returns; returns the record that stands (an
        earlier attempt's, if one was recorded first)."""
        key = remote_tasks_key(job_id)
        pipe = self.redis.pipeline()
        pipe.hsetnx(key, action_id, dumps(record))
        pipe.hget(key, action_id)
        pipe.expire(key, self._ttl(job_id))
        raw = pipe.execute()[1]
        self._barrier("record_remote_task")
        return dict(json.loads(raw))
