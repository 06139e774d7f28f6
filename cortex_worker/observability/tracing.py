"""Traces: one OpenTelemetry trace per job, exported over OTLP when it is configured.

Nothing is exported, and every function here costs next to nothing, unless the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and the `otel`
extra is installed; the SDK's own `OTEL_*` variables (service name, batch delay, headers)
apply as usual.

- A job's trace id and root span id are derived from its id, so every process, and a message
  the reconciler sends again, joins the same trace without asking anyone. The root span
  (`job`) is recorded when the job ends, with its start and end times.
- A task message carries the span that sent it in a W3C `traceparent` header; the worker that
  runs it opens the task's span under it. A message sent outside any span (a job's start, a
  reconciler pass) hangs under the job's root.
- Inside: `turn` spans (agent turns), model calls after the GenAI semantic conventions
  (`chat <model>`, token usage), and one span per action run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from cortex_worker.llm.config import ModelConfig
    from cortex_worker.llm.sse import T, Take
    from cortex_worker.llm.stream import Piece

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
HEADER = "traceparent"


class _Exporting:
    """This process's tracer (None: not exporting) and the SDK's provider behind it, set up
    by `configure` once per process (`pid`: the process that did)."""

    def __init__(self) -> None:
        self.tracer: Tracer | None = None
        self.provider: Any = None
        self.pid: int | None = None
        self.lock = threading.Lock()


_here = _Exporting()
_forced_ids: ContextVar[tuple[int, int] | None] = ContextVar("cortex_forced_ids", default=None)
_task_spans: dict[str, tuple[Any, object]] = {}  # task id -> (span, context token)


def enabled() -> bool:
    return _here.tracer is not None


def configure(service: str) -> bool:
    """Export this process's spans if an OTLP endpoint is set; once per process (a prefork
    child configures its own: the exporter's thread does not survive a fork)."""
    with _here.lock:
        if _here.pid == os.getpid():
            return _here.tracer is not None
        _here.pid, _here.tracer, _here.provider = os.getpid(), None, None
        if not any(os.environ.get(name) for name in ENDPOINT_VARIABLES):
            return False
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed "
                        "(pip install 'cortex[otel]'): no traces are exported")
            return False
        name = os.environ.get("OTEL_SERVICE_NAME") or service
        provider = TracerProvider(resource=Resource.create({"service.name": name}),
                                  id_generator=_job_ids())
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _here.provider, _here.tracer = provider, provider.get_tracer("cortex")
        return True


def flush() -> None:
    """Export what is buffered now (a worker process about to exit)."""
    if _here.provider is not None:
        _here.provider.force_flush()


def job_ids(job_id: str) -> tuple[int, int]:
    """The trace id and root span id of a job: the same in every process."""
    digest = hashlib.sha256(job_id.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def _job_ids() -> Any:
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

    class JobIds(IdGenerator):
        """Random ids, except while a job's root span is made (`_forced_ids`)."""

        def __init__(self) -> None:
            self.random = RandomIdGenerator()

        def generate_trace_id(self) -> int:
            forced = _forced_ids.get()
            return forced[0] if forced else self.random.generate_trace_id()

        def generate_span_id(self) -> int:
            forced = _forced_ids.get()
            return forced[1] if forced else self.random.generate_span_id()

    return JobIds()


def _job_context(job_id: str) -> Any:
    """A context whose span is the job's root (remote: it is recorded when the job ends)."""
    from opentelemetry import trace

    trace_id, span_id = job_ids(job_id)
    root = trace.SpanContext(trace_id, span_id, is_remote=True,
                             trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(root))


def _parent(job_id: str | None) -> Any:
    """The current span's context, else the job's root."""
    from opentelemetry import trace

    if trace.get_current_span().get_span_context().is_valid or not job_id:
        return None
    return _job_context(job_id)


def span(name: str, job_id: str | None = None,
         attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Span | None]:
    """A span around a block, current inside it (a no-op when not exporting)."""
    tracer = _here.tracer
    if tracer is None:
        return nullcontext()
    return tracer.start_as_current_span(name, context=_parent(job_id),
                                         attributes=dict(attributes or {}))


def record_job(job_id: str, started_at: float | None, status: str,
               attributes: Mapping[str, Any]) -> None:
    """The job's root span, from its start to now (called once, when it ends)."""
    tracer = _here.tracer
    if tracer is None:
        return
    from opentelemetry.trace import Status, StatusCode

    token = _forced_ids.set(job_ids(job_id))
    try:
        root = tracer.start_span("job", context={}, start_time=int(
            (started_at or time.time()) * 1e9), attributes={
            "cortex.job.id": job_id, "cortex.job.status": status, **attributes})
    finally:
        _forced_ids.reset(token)
    if status != "completed":
        root.set_status(Status(StatusCode.ERROR, status))
    root.end()


def model_stream(config: ModelConfig, start: Callable[[Take[T]], Iterator[T]],
                 take: Take[T]) -> Iterator[T]:
    """`start(take)` (a model stream whose pieces go to `take`) inside a GenAI client span
    `chat <model>` with the usage it reports."""
    tracer = _here.tracer
    if tracer is None:
        return start(take)
    return _model_stream(tracer, config, start, take)


def _model_stream(tracer: Tracer, config: ModelConfig, start: Callable[[Take[T]], Iterator[T]],
                  take: Take[T]) -> Iterator[T]:
    from opentelemetry.trace import SpanKind, Status, StatusCode

    from cortex_worker.llm.stream import ModelError, Usage

    attributes = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": config.provider,
                  "gen_ai.system": config.provider, "gen_ai.request.model": config.model}
    if config.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = config.max_tokens
    if config.temperature is not None:
        attributes["gen_ai.request.temperature"] = config.temperature
    # not made current: a generator's caller would run under it between pieces (the actions
    # a turn dispatches belong to the turn, not to the model call)
    current = tracer.start_span(f"chat {config.model}", kind=SpanKind.CLIENT,
                                attributes=attributes)

    def observed(piece: Piece) -> T | None:  # in whichever thread reads the stream
        if isinstance(piece, Usage):
            current.set_attribute("gen_ai.usage.input_tokens", piece.prompt_tokens)
            current.set_attribute("gen_ai.usage.output_tokens", piece.completion_tokens)
        return take(piece)

    try:
        yield from start(observed)  # closing this generator closes the stream
    except ModelError as exc:
        current.set_status(Status(StatusCode.ERROR, str(exc)))
        current.set_attribute("error.type", "ModelError")
        raise
    finally:
        current.end()


# -- task messages (Celery's signals, connected by `cortex_worker.worker.signals`) ------------
def inject_headers(headers: dict[str, Any] | None = None, body: Any = None, **_: Any) -> None:
    """`before_task_publish`: the message carries the span that sends it (else its job's)."""
    if _here.tracer is None or headers is None:
        return
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier, context=_parent(_job_of(body)))
    if HEADER in carrier:
        headers[HEADER] = carrier[HEADER]


def start_task_span(task_id: str | None = None, task: Any = None, args: Any = None,
                    **_: Any) -> None:
    """`task_prerun`: the task's span, under the one its message carries, made current."""
    tracer = _here.tracer
    if tracer is None or task is None or task_id is None:
        return
    from opentelemetry import context, trace
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    request = task.request
    carried = getattr(request, HEADER, None) or (getattr(request, "headers", None) or {}).get(HEADER)
    job_id = args[0] if args and isinstance(args[0], str) else None
    parent = extract({HEADER: carried}) if carried else (_job_context(job_id) if job_id else None)
    attributes = {"messaging.system": "celery", "messaging.destination.name":
                  (request.delivery_info or {}).get("routing_key") or ""}
    if job_id:
        attributes["cortex.job.id"] = job_id
    if args and len(args) > 1 and isinstance(args[1], str):
        attributes["cortex.action.id"] = args[1]
    started = tracer.start_span(task.name, context=parent, kind=SpanKind.CONSUMER,
                                 attributes=attributes)
    _task_spans[task_id] = (started, context.attach(trace.set_span_in_context(started)))


def end_task_span(task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    """`task_postrun`: the task's span ends (an error if the task raised)."""
    entry = _task_spans.pop(task_id or "", None)
    if entry is None:
        return
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode

    started, token = entry
    if state == "FAILURE":
        started.set_status(Status(StatusCode.ERROR, "the task raised"))
    context.detach(token)  # type: ignore[arg-type]
    started.end()


def _job_of(body: Any) -> str | None:
    """The job id of a task message: every Cortex task's first argument."""
    try:
        args = body[0]  # protocol 2: (args, kwargs, embed)
    except (TypeError, IndexError, KeyError):
        return None
    return args[0] if args and isinstance(args[0], str) else None


def outcome(current: Span | None, status: str, error: str | None) -> None:
    """An action span's outcome: its status, and an error status unless it ended ok."""
    if current is None:
        return
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("cortex.action.status", status)
    if status not in ("ok", "deferred"):
        current.set_status(Status(StatusCode.ERROR, error or status))


@contextmanager
def action_span(job_id: str, spec: Mapping[str, Any], attempt: int) -> Iterator[Any]:
    """The span of one action's run: `<type> <name>`, its outcome set by the caller."""
    with span(f"{spec['type']} {spec['name']}", job_id, {
            "cortex.job.id": job_id, "cortex.action.id": spec["id"],
            "cortex.action.type": spec["type"], "cortex.action.name": spec["name"],
            "cortex.action.attempt": attempt}) as current:
        yield current
