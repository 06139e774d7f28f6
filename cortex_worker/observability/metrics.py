"""Prometheus metrics, read from Redis at scrape time (the API keeps no state of its own).

The job scripts (lua/prelude.lua) keep the counters and histograms up to date: `cx:metrics`
(`jobs_ended|<status>`, `actions_ended|<type>|<status>`) and one hash per histogram, whose
fields are `<labels>|<le>` (a count per bucket, not cumulative) and `<labels>|sum`. This module
turns them into metric families; the queue lengths come from the broker, and the jobs by status
from a bounded walk of the job index. Documented in docs/runtime.md#metrics.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import Any

import redis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cortex_worker.pools import NAMES, broker_lists
from cortex_worker.protocol.events import JOB_LIVE, JobStatus
from cortex_worker.store.keys import (
    JOBS_INDEX,
    METRIC_COUNTERS,
    METRIC_DISPATCH,
    METRIC_DURATION,
    MODELS_INDEX,
    job_keys,
    model_keys,
)

#: `cortex_jobs{status}` counts the newest jobs of the index, at most this many.
JOB_SCAN_LIMIT = 10_000


def buckets() -> tuple[float, ...]:
    """The histogram bucket bounds, as the scripts use them (`M_BUCKETS` in prelude.lua)."""
    text = (resources.files("cortex_worker.store") / "lua" / "prelude.lua").read_text()
    found = re.search(r"^local M_BUCKETS = \{([^}]*)\}", text, re.MULTILINE)
    if found is None:
        raise RuntimeError("M_BUCKETS not found in lua/prelude.lua")
    return tuple(float(x) for x in found.group(1).split(","))


BUCKETS = buckets()


def _histograms(raw: dict[str, str], labels: int) -> dict[tuple[str, ...], tuple[dict[float, int], float]]:
    """Fields `<l1>|...|<ln>|<le or sum>` -> {labels: ({le: count}, sum)}."""
    out: dict[tuple[str, ...], tuple[dict[float, int], float]] = {}
    for field, value in raw.items():
        parts = field.split("|")
        if len(parts) != labels + 1:
            continue
        key, last = tuple(parts[:labels]), parts[labels]
        counts, total = out.get(key, ({}, 0.0))
        if last == "sum":
            total = float(value)
        else:
            le = math.inf if last == "+Inf" else float(last)
            counts[le] = counts.get(le, 0) + int(value)
        out[key] = (counts, total)
    return out


def _histogram_family(name: str, doc: str, label_names: Sequence[str],
                      raw: dict[str, str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(label_names))
    for labels, (counts, total) in sorted(_histograms(raw, len(label_names)).items()):
        cumulative, rows = 0, []
        for bound in (*BUCKETS, math.inf):
            cumulative += counts.pop(bound, 0)
            rows.append((floatToGoString(bound), cumulative))
        # a bound the scripts used that BUCKETS lacks: fold it into +Inf rather than lose it
        rows[-1] = ("+Inf", cumulative + sum(counts.values()))
        family.add_metric(list(labels), rows, total)
    return family


class CortexCollector(Collector):
    """Reads the metrics from Redis on every scrape; `broker` is the Celery broker's Redis
    (None when the broker is not Redis: no queue lengths then)."""

    def __init__(self, client: redis.Redis, broker: redis.Redis | None = None, *,
                 queues: Sequence[str] = NAMES, job_scan_limit: int = JOB_SCAN_LIMIT) -> None:
        self.redis, self.broker = client, broker
        self.queues, self.job_scan_limit = tuple(queues), job_scan_limit

    def describe(self) -> list[Metric]:
        return []  # no read at registration

    def collect(self) -> Iterator[Metric]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(METRIC_COUNTERS)
        pipe.hgetall(METRIC_DISPATCH)
        pipe.hgetall(METRIC_DURATION)
        pipe.zrevrange(JOBS_INDEX, 0, self.job_scan_limit - 1)
        counters, dispatch, duration, job_ids = pipe.execute()
        counters, dispatch, duration = (_text(counters), _text(dispatch), _text(duration))

        jobs_ended = CounterMetricFamily("cortex_jobs_ended", "Jobs ended, by final status.",
                                         labels=["status"])
        actions_ended = CounterMetricFamily(
            "cortex_actions_ended", "Actions ended, by action type and final status.",
            labels=["type", "status"])
        drains = CounterMetricFamily(
            "cortex_agent_drains", "Agent jobs left with nothing to wait for (their next turn, or "
            "their end, is due), by who took it: in_place (the coordinator's thread, at its "
            "turn's end or waiting for the actions) or queued (a turn task sent to the pool).",
            labels=["taken"])
        stale = CounterMetricFamily(
            "cortex_stale_writes", "Writes refused because their holder's lease was taken over "
            "(a paused process that woke up; fencing), by what was written: events, register, "
            "result, retry, turn_start, turn_end, turn_renew, turn_yield, job_end.",
            labels=["write"])
        unreplicated = CounterMetricFamily(
            "cortex_unreplicated_writes", "Writes of job state no replica acknowledged within "
            "redis_replica_wait_ms (a failover then could lose them), by the store's script.",
            labels=["write"])
        families = {"jobs_ended": (jobs_ended, 2), "actions_ended": (actions_ended, 3),
                    "agent_drains": (drains, 2), "stale_writes": (stale, 2),
                    "unreplicated_writes": (unreplicated, 2)}
        for field, value in sorted(counters.items()):
            parts = field.split("|")
            family, size = families.get(parts[0], (None, 0))
            if family is not None and len(parts) == size:
                family.add_metric(parts[1:], int(value))
        yield jobs_ended
        yield actions_ended
        yield drains
        yield stale
        yield unreplicated
        yield _histogram_family(
            "cortex_action_dispatch_seconds",
            "Time from an action being queued to a worker claiming it, by action type.",
            ["type"], dispatch)
        yield _histogram_family(
            "cortex_action_duration_seconds",
            "Time from an action's last claim to its end, by action type and final status.",
            ["type", "status"], duration)

        statuses = {status.value: 0 for status in JobStatus}
        if job_ids:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hget(job_keys(_str(job_id)).job, "status")
            for status in pipe.execute():
                if status is not None:  # expired jobs stay in the index
                    statuses[_str(status)] = statuses.get(_str(status), 0) + 1
        jobs = GaugeMetricFamily(
            "cortex_jobs", f"Jobs by status, among the newest {self.job_scan_limit} of the index.",
            labels=["status"])
        for status, count in statuses.items():
            jobs.add_metric([status], count)
        yield jobs
        yield GaugeMetricFamily("cortex_jobs_running",
                                "Jobs not ended yet (queued, running or finishing).",
                                value=sum(statuses[s] for s in JOB_LIVE))

        yield from self._models()

        if self.broker is not None:
            pipe = self.broker.pipeline(transaction=False)
            for queue in self.queues:
                for name in broker_lists(queue):
                    pipe.llen(name)
            lengths = iter(pipe.execute())
            family = GaugeMetricFamily("cortex_queue_length",
                                       "Tasks waiting in each pool's Celery queue (the broker's "
                                       "lists of its lanes and priorities, summed).",
                                       labels=["queue"])
            for queue in self.queues:
                family.add_metric([queue], sum(int(next(lengths))
                                               for _ in broker_lists(queue)))
            yield family

    def _models(self) -> Iterator[Metric]:
        """Each model endpoint's shared limits (llm/limits.py): requests, 429s and waits so
        far; requests in flight and waiting now."""
        endpoints = sorted(_str(e) for e in self.redis.smembers(MODELS_INDEX))
        pipe = self.redis.pipeline(transaction=False)
        for endpoint in endpoints:
            keys = model_keys(endpoint)
            pipe.hmget(keys.state, "requests", "refused", "waits")
            pipe.zcard(keys.inflight)
            pipe.zcard(keys.waiting)
        out = pipe.execute()
        families = [
            CounterMetricFamily("cortex_model_requests", "Requests sent to each model endpoint "
                                "whose limits Cortex keeps.", labels=["endpoint"]),
            CounterMetricFamily("cortex_model_rate_limited", "Answers of 429 or 529 (the "
                                "provider's limit or overload) from each model endpoint.",
                                labels=["endpoint"]),
            CounterMetricFamily("cortex_model_waits", "Requests that waited for a slot of each "
                                "model endpoint.", labels=["endpoint"]),
            GaugeMetricFamily("cortex_model_in_flight", "Requests in flight to each model "
                              "endpoint.", labels=["endpoint"]),
            GaugeMetricFamily("cortex_model_waiting", "Requests waiting for a slot of each "
                              "model endpoint.", labels=["endpoint"]),
        ]
        for at, endpoint in enumerate(endpoints):
            counts, flying, waiting = out[3 * at: 3 * at + 3]
            for family, value in zip(families, [*counts, flying, waiting], strict=True):
                family.add_metric([endpoint], int(value or 0))
        yield from families


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(raw: dict[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in raw.items()}
