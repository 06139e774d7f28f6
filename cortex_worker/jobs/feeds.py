"""Context feeds (protocol.md §6): values the runtime computes and shows the model.

A feed is declared in the agent manifest or added at run time (`add_context_feed`); both are
`FeedSpec`s and behave the same. `on_demand` feeds are computed when a prompt is built;
`periodic` ones are refreshed every `interval` seconds while the job runs (`feed_updated`).
Each value is also the variable `$<feed id>`. A source that fails gives `{"error": ...}` and
a `warning` event; the job goes on.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from cortex_worker.actions import dispatch
from cortex_worker.actions.table import ACTION_TYPES
from cortex_worker.agents.spec import FeedSpec
from cortex_worker.errors import CortexError
from cortex_worker.handles import get_job_ends, get_registry
from cortex_worker.jobs.kinds import KINDS
from cortex_worker.jobs.lifecycle import cancel_job, submit_workflow
from cortex_worker.jobs.options import JobOptions
from cortex_worker.jobs.record import JobRecord
from cortex_worker.store.keys import feed_cache_key
from cortex_worker.store.state import Store, dumps

CHARS_PER_TOKEN = 4
SOURCE_TIMEOUT_S = 30.0


class FeedError(CortexError, ValueError):
    """A feed that cannot be added, changed or computed; the message says why."""


# -- the feeds of a job ---------------------------------------------------------------------
def job_feeds(store: Store, job_id: str, agent: str | None,
              changes: Mapping[str, dict[str, Any]] | None = None) -> dict[str, FeedSpec]:
    """The manifest's feeds with the job's run-time changes applied (removed ones left out);
    `changes`: those changes, if the caller read them already."""
    feeds: dict[str, FeedSpec] = {}
    if agent:
        spec = get_registry().agents.get(agent)
        feeds = {f.id: f for f in spec.context_feeds} if spec else {}
    if changes is None:
        changes = store.feed_changes(job_id)
    for feed_id, data in changes.items():
        if data.get("removed"):
            feeds.pop(feed_id, None)
        else:
            feeds[feed_id] = FeedSpec.model_validate(data["spec"])
    return feeds


def feed_generation(store: Store, job_id: str, feed_id: str) -> int:
    change = store.feed_change(job_id, feed_id)
    return int(change.get("gen", 0)) if change else 0


def save_feed(store: Store, job_id: str, spec: FeedSpec | None, feed_id: str) -> int:
    """Store a run-time feed (None: removed); returns its new generation."""
    gen = feed_generation(store, job_id, feed_id) + 1
    value = {"removed": True, "gen": gen} if spec is None else \
        {"spec": spec.model_dump(mode="json"), "gen": gen}
    store.set_feed_change(job_id, feed_id, value)
    return gen


def parse_feed(data: Any) -> FeedSpec:
    """A FeedSpec from action parameters, with a message that names the bad field."""
    try:
        return FeedSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "feed"
        raise FeedError(f"invalid context feed: {where}: {first['msg']}") from None


# -- values ---------------------------------------------------------------------------------
def compute(store: Store, job_id: str, agent: str | None, feed: FeedSpec) -> Any:
    """The feed's current value (from the cache its agent's jobs share while fresh); errors
    become values."""
    cache = _cache_key(store, job_id, agent, feed) if feed.cache_ttl else ""
    if cache:
        cached = store.cached(cache)
        if cached is not None:
            return cached
    try:
        value = _source(store, job_id, agent, feed)
    except Exception as exc:  # a failing source must not stop the job
        store.emit(job_id, [("warning", {"kind": "feed_failed", "feed_id": feed.id,
                                         "message": f"context feed {feed.id!r} failed: {exc}"})])
        return {"error": f"context feed {feed.id!r} failed: {exc}"}
    value = truncate(value, feed.max_tokens)
    if cache:
        store.cache(cache, value, feed.cache_ttl)
    return value


def _cache_key(store: Store, job_id: str, agent: str | None, feed: FeedSpec) -> str:
    """Jobs share a cached value when they have the same tenant and agent, and the feed the
    same id, source and size limit."""
    tenant = (store.peek(job_id, "tenant") or JobRecord(id=job_id)).tenant
    what = dumps([feed.source.model_dump(mode="json"), feed.max_tokens])
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    return feed_cache_key(tenant, agent or "documents", feed.id, digest)


def truncate(value: Any, max_tokens: int | None) -> Any:
    """Cut a value past `max_tokens` (about 4 characters each) to text with a marker."""
    if not max_tokens:
        return value
    text = value if isinstance(value, str) else dumps(value)
    limit = max_tokens * CHARS_PER_TOKEN
    if len(text) <= limit:
        return value
    return f"{text[:limit]}…[truncated to {max_tokens} tokens]"


def refusal(agent: str | None, feed: FeedSpec) -> str | None:
    """Why the agent may not add (at run time) a feed with this source: the tools, relics and
    workflows its manifest lists bind feeds as they bind actions. None if it may. The
    manifest's own feeds are the operator's choice and are not checked; documents have no
    lists."""
    spec = get_registry().agents.get(agent) if agent else None
    row = ACTION_TYPES[feed.source.type]
    if spec is None or row.in_turn:  # computed here (the clock…): nothing a manifest lists
        return None
    return row.grant(spec, feed.source.name)


def _source(store: Store, job_id: str, agent: str | None, feed: FeedSpec) -> Any:
    source = feed.source
    row = ACTION_TYPES[source.type]
    if row.in_turn:
        return _internal(store, job_id, source.name)
    if row.child_job:
        return _run_workflow(store, job_id, source.name, source.params)
    spec = {"id": f"feed:{feed.id}", "type": source.type, "name": source.name,
            "parameters": source.params, "agent": agent, "depth": 0}
    if row.needs_model:
        spec["model"] = _model(store, job_id)
    return dispatch.invoke(spec, timeout=SOURCE_TIMEOUT_S, job_id=job_id)


def _model(store: Store, job_id: str) -> dict[str, Any]:
    """The model of the job's llm actions (its kind's: see `JobKind.model`)."""
    job = store.get_job(job_id)
    model = KINDS[job.kind].model(job) if job else None
    if model is None:
        raise FeedError("llm feeds need a model: an agent's, or CORTEX_DOCUMENT_MODEL in "
                        "documents")
    return model.wire()


def _internal(store: Store, job_id: str, name: str) -> Any:
    if name == "clock":
        return datetime.now(UTC).isoformat(timespec="seconds")
    if name == "job_stats":
        job = store.peek(job_id, "turn", "started_at", "created_at") or JobRecord(id=job_id)
        counts: dict[str, int] = {}
        for status in store.action_statuses(job_id).values():
            counts[status] = counts.get(status, 0) + 1
        started = job.begun_at or time.time()
        return {"actions": counts, "turn": job.turn,
                "elapsed_s": round(time.time() - started, 3)}
    if name == "variables":
        return store.variable_names(job_id)
    raise FeedError(f"unknown internal feed source {name!r} (clock, job_stats or variables)")


def _run_workflow(store: Store, job_id: str, name: str, inputs: dict[str, Any]) -> Any:
    """Run the workflow as a job of the same tenant and wait for its output (woken by its
    end); it is cancelled if it outlives SOURCE_TIMEOUT_S or the job that wants it ends first."""
    tenant = (store.peek(job_id, "tenant") or JobRecord(id=job_id)).tenant
    child = submit_workflow(store, name, inputs, options=JobOptions(), tenant=tenant)
    deadline = time.monotonic() + SOURCE_TIMEOUT_S
    ends = get_job_ends()
    with ends.watch(child) as pushed:
        while time.monotonic() < deadline:
            job = store.peek(child, "status", "result", "error")
            if job is not None and job.ended:
                if job.status != "completed":
                    raise FeedError(f"workflow {name!r} {job.status}: {job.error}")
                try:
                    return json.loads(job.result)
                except ValueError:
                    return job.result
            wanter = store.peek(job_id, "status")
            if wanter is None or wanter.ended:
                cancel_job(store, child, reason=f"job {job_id} that wanted this feed ended")
                raise FeedError(f"job {job_id} ended before workflow {name!r} did")
            # woken by the child's end; the wanting job's end (and an end that pub/sub missed
            # while reconnecting) is seen within a second
            pushed.ended.wait(min(1.0, max(0.0, deadline - time.monotonic())))
    cancel_job(store, child, reason=f"a context feed waited {SOURCE_TIMEOUT_S:g} s for it")
    raise FeedError(f"workflow {name!r} did not finish within {SOURCE_TIMEOUT_S:g} s")


def current_values(store: Store, job_id: str, agent: str | None,
                   changes: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Values of the job's enabled feeds for a prompt: on_demand ones computed now, periodic
    ones as last refreshed. Each is also stored as the variable of the feed's id."""
    feeds = {i: f for i, f in job_feeds(store, job_id, agent, changes).items() if f.enabled}
    if not feeds:
        return {}
    stored = store.variables(job_id, [i for i, f in feeds.items() if f.type == "periodic"])
    values = {}
    for feed_id, feed in feeds.items():
        if feed.type == "periodic" and feed_id in stored:
            values[feed_id] = stored[feed_id]
        else:
            values[feed_id] = compute(store, job_id, agent, feed)
    store.set_variables(job_id, values)
    return values


def refresh(store: Store, job_id: str, feed_id: str, generation: int) -> float | None:
    """One periodic refresh; returns the delay until the next one, or None to stop."""
    job = store.peek(job_id, "status", "agent")
    if job is None or job.ended:
        return None
    if feed_generation(store, job_id, feed_id) != generation:
        return None  # removed or changed since: a newer schedule (if any) took over
    feed = job_feeds(store, job_id, job.agent).get(feed_id)
    if feed is None or feed.type != "periodic" or not feed.interval:
        return None
    if feed.enabled:
        value = compute(store, job_id, job.agent, feed)
        store.set_variables(job_id, {feed_id: value})
        store.emit(job_id, [("feed_updated", {"feed_id": feed_id, "value": value})])
    return feed.interval
