"""Every Redis key and channel Cortex uses, named in one place.

A job's keys share the hash tag `{job_id}`, so a job lives on one Redis shard. The Lua scripts
take the first `SCRIPT_KEYS` of `JobKeys` in this order (see lua/prelude.lua).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

PREFIX = "cx"
#: Every job id, scored by creation time (the per-tenant indexes: `tenant_index`).
JOBS_INDEX = f"{PREFIX}:jobs"
#: Pub/sub channel on which the `close` script publishes the id of every job that ends.
ENDED_CHANNEL = f"{PREFIX}:ended"
#: Global metric counters and histograms (written by the scripts, read by `metrics`).
METRIC_COUNTERS = f"{PREFIX}:metrics"
METRIC_DISPATCH = f"{PREFIX}:metrics:hist:dispatch"
METRIC_DURATION = f"{PREFIX}:metrics:hist:duration"
#: Ids of the jobs that have not ended: what the reconciler looks at (see `reconciler`).
ACTIVE_JOBS = f"{PREFIX}:active"
#: Held for one pass by the process that reconciles now (one at a time, any may).
RECONCILER_LOCK = f"{PREFIX}:reconciler"
#: Hash: tenant -> the lane of each pool's queue its work goes to (`actions/fairness.py`).
TENANT_LANES = f"{PREFIX}:lanes"
#: The model endpoints whose limits are kept (`model_keys`): what metrics report on.
MODELS_INDEX = f"{PREFIX}:models"
#: The built-in key-value relic's keys start with this (`relic_kv_key`).
RELIC_KV_PREFIX = f"{PREFIX}:relic:kv"
#: Written to make the replicas' acknowledgement cover every write before it (`Store._barrier`).
REPLICATION_MARK = f"{PREFIX}:replication:mark"
#: How long a job's keys live when its record does not say (7 days).
DEFAULT_TTL_S = 604800
#: How many of `JobKeys` the scripts take (KEYS[1..16]).
SCRIPT_KEYS = 16


class JobKeys(NamedTuple):
    """The keys of one job (the first `SCRIPT_KEYS`, in this order, are the scripts' KEYS)."""

    job: str  # hash: the job record (see record.JobRecord)
    spec: str  # hash: action id -> spec JSON
    status: str  # hash: action id -> status
    result: str  # hash: action id -> result record JSON
    pending: str  # hash: action id -> unfinished dependency count
    poison: str  # hash: action id -> failed dependency, if one did
    deps: str  # hash: action id -> dependents JSON
    vars: str  # hash: variable name -> value JSON
    lease: str  # hash: action id -> owner and lease
    wait: str  # list: ready actions waiting for a free slot (max_parallel)
    seq: str  # counter: the last event's seq
    events: str  # stream: the event log
    onerr: str  # hash: action id -> on_error
    attempts: str  # hash: action id -> attempts started
    awaiting: str  # hash: actions the current turn waits for
    inbox: str  # list: actions finished since the turn began
    conversation: str  # list: an agent's messages (read by lua/turn_start.lua, written by Python)
    children: str  # set: child job ids
    feeds: str  # hash: feed id -> run-time feed change
    redrives: str  # hash: action id -> times the reconciler sent it again
    timings: str  # hash: `t|<id>` type, `q|<id>` when queued (built by the scripts: prelude.lua)
    approvals: str  # hash: action id -> approval record JSON (approvals.py)
    usage: str  # hash: `<endpoint>|prompt_tokens` / `|completion_tokens` / `|requests` -> count
    partial: str  # string: the text the turn in progress has streamed (built by the scripts:
    #               prelude.lua), kept where its model can continue it (`continuation`)


_SUFFIXES = {"awaiting": "await", "timings": "tm"}  # a field named as the key is, where that is a keyword


@lru_cache(maxsize=4096)  # a streaming turn logs its chunks 20 times a second
def job_keys(job_id: str) -> JobKeys:
    """The Redis keys of one job."""
    return JobKeys(*(f"{PREFIX}:{{{job_id}}}:{_SUFFIXES.get(field, field)}"
                     for field in JobKeys._fields))


def write_memo_key(job_id: str, write: str) -> str:
    """String: the reply of a job script's write, by its write id, for 300 s (lua/prelude.lua:
    `once` builds it the same way): the same write sent again is answered from it."""
    return f"{PREFIX}:{{{job_id}}}:w:{write}"


def tenant_index(tenant: str) -> str:
    """The per-tenant job index (`JOBS_INDEX` holds every job)."""
    return f"{JOBS_INDEX}:{tenant}"


def channel(job_id: str) -> str:
    """The pub/sub channel a job's events are published on."""
    return f"{PREFIX}:ev:{job_id}"


def alive_key(owner: str) -> str:
    """Present while the worker process `owner` (host:pid) beats (see `heartbeat`)."""
    return f"{PREFIX}:alive:{owner}"


def wake_channel(owner: str) -> str:
    """Pub/sub channel on which a drain is handed to the agent turn of `owner` (host:pid) that
    waits in place for it (the job record's `turn_waiter`, see lua/prelude.lua: job_drained)."""
    return f"{PREFIX}:wake:{owner}"


def slot_keys(gate: str) -> tuple[str, str]:
    """The keys of a cap on actions running at once (`gate`: `tool:<name>` for a tool's
    `max_concurrency`, `tenant:<name>` for a tenant's `max_actions_in_flight`): a sorted set of
    the actions running now (`job:action` scored by the end of its lease, so a dead worker's
    slot frees itself), and a list of those waiting for a slot (JSON: job_id, spec)."""
    return f"{PREFIX}:{gate}:slots", f"{PREFIX}:{gate}:waiting"


class ModelKeys(NamedTuple):
    """The keys of one model endpoint's shared limits (`llm.limits`), in the order
    lua/model_take.lua and lua/model_give.lua take them; hash tag `{model:<endpoint>}`."""

    state: str  # hash: pause_until, budget, budget_reset, tat, tokens, tokens_at, cap, counters
    inflight: str  # sorted set: requests in flight (holder -> lease end)
    waiting: str  # sorted set: requests waiting for a slot (holder -> arrival)
    waiters: str  # hash: holder -> "tenant|last poll"
    served: str  # hash: tenant -> when it last got a slot (whose turn it is)


@lru_cache(maxsize=256)
def model_keys(endpoint: str) -> ModelKeys:
    """The shared-limit keys of the model endpoint `endpoint` (`ModelConfig.endpoint()`)."""
    return ModelKeys(*(f"{PREFIX}:{{model:{endpoint}}}:{field}" for field in ModelKeys._fields))


def usage_key(tenant: str, period: str) -> str:
    """A tenant's model usage in one UTC day (`2026-11-28`) or month (`2026-11`): a hash of
    `<endpoint>|prompt_tokens`, `|completion_tokens`, `|requests`, and `tokens` (all of them)."""
    return f"{PREFIX}:usage:{tenant}:{period}"


def tenant_running_key(tenant: str) -> str:
    """Set: the jobs of `tenant` admitted to run under its `max_running_jobs` (jobs/tenants.py)."""
    return f"{PREFIX}:tenant:{tenant}:running"


def session_key(session_id: str) -> str:
    """A session's hash; its messages and jobs are lists at `:messages` and `:jobs`."""
    return f"{PREFIX}:session:{session_id}"


def agui_runs_key(session_id: str) -> str:
    """Hash: the AG-UI runs of a session (an AG-UI thread): run id -> JSON `{job, after,
    until, at}`, the job the run is and the part of its log it covers (cortex_api/routes/agui.py)."""
    return f"{PREFIX}:session:{session_id}:agui"


def feed_cache_key(tenant: str, owner: str, feed_id: str, digest: str) -> str:
    """A feed value shared by the jobs of one tenant and agent (`owner`) while fresh."""
    return f"{PREFIX}:feedcache:{tenant}:{owner}:{feed_id}:{digest}"


def relic_kv_key(namespace: str, key: str) -> str:
    """A key of the built-in `kv` relic: one namespace per agent, so agents never share keys
    (`relic_kv_key(namespace, "")` is the namespace's prefix, for SCAN)."""
    return f"{RELIC_KV_PREFIX}:{namespace}:{key}"


def mcp_listing_key(digest: str) -> str:
    """An MCP server's shared tool listing, by the digest of its configuration
    (`services.mcp.listing`); `<key>:lock` is held by the process listing it."""
    return f"{PREFIX}:mcp:tools:{digest}"


def remote_tasks_key(job_id: str) -> str:
    """Hash: action id -> the A2A task a `kind: RemoteAgent` call of the job started (JSON
    `{task_id, context_id, agent}`), so a later attempt follows it instead of sending again."""
    return f"{PREFIX}:{{{job_id}}}:a2a"
