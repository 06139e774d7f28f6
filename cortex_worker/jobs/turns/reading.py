"""Reading one generation: the model's stream through the parser, text logged as chunks,
and each action registered and dispatched the moment its `</action>` closes."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from cortex_worker.actions import dispatch, executor
from cortex_worker.actions.table import ACTION_TYPES
from cortex_worker.agents.spec import AgentSpec
from cortex_worker.jobs.record import JobRecord
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.stream import (
    Piece,
    ToolCall,
    Usage,
    tool_call_to_protocol,
)
from cortex_worker.plan.stream import StreamPlanner
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.actions import Action
from cortex_worker.recovery import fencing
from cortex_worker.settings import get_settings
from cortex_worker.store.chunk_writer import ChunkWriter
from cortex_worker.store.state import Store, dumps

STATUS_CHECK_S = 5.0  # how often a streaming turn looks at its job's status and renews its lease
#                      (a backstop: jobs.ends pushes ends; the wall time is checked at every token)
FLUSH_S = 0.05  # the most a thought or response chunk waits before it is logged
CHUNK_EVENTS = {p.TEXT, p.THOUGHT_CHUNK, p.RESPONSE_CHUNK, p.THOUGHT_END, p.CONTEXT_FEED,
                p.WARNING, p.PROTOCOL_ERROR}


@dataclass
class Turn:
    """What one generation produced."""

    actions: int = 0
    final: bool = False
    errors: list[dict[str, Any]] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)
    stopped_at: int | None = None  # offset just past a sync action's </action>
    limit: str | None = None  # a limit the turn hit; the job ends with it
    ended: bool = False  # the job ended (cancelled, or its wall time ran out) mid-generation
    batch: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    tagged: bool = False  # the model wrote protocol (a tag, or a malformed one)
    plain: list[str] = field(default_factory=list)  # text outside any tag
    native: list[tuple[ToolCall, str]] = field(default_factory=list)  # (call, its protocol text)
    drained: bool = False  # once it ended: nothing is left to wait for, the next turn is due
    retaken: bool = False  # the turn was taken over: its dead coordinator may have registered
    #                        some of its actions already
    fence: int | None = None  # the turn's fencing number: every write of the turn carries it
    streamed: list[str] = field(default_factory=list)  # model text not yet kept as `partial`
    replaying: bool = False  # taking over a partial answer: its events were logged already


class Reading:
    """One generation's stream through the parser. `take` runs in the process's stream
    reader thread (`llm/reader.py`), one piece at a time: it logs text as chunks and hands the
    turn's thread only what needs it (an action to register, a look at the job's status), so
    that thread does not wake for every token."""

    def __init__(self, store: Store, job_id: str, job: JobRecord, agent: AgentSpec,
                 planner: StreamPlanner, depth: int, model: ModelConfig, names: dict[str, str],
                 job_ended: threading.Event, retaken: bool, fence: int | None,
                 keep_streamed: bool = False) -> None:
        self.store, self.job_id, self.agent, self.planner = store, job_id, agent, planner
        self.depth, self.model, self.names, self.job_ended = depth, model, names, job_ended
        self.state = Turn(retaken=retaken, fence=fence)
        self.keep_streamed = keep_streamed  # the model can continue it: keep it as `partial`
        self.skip = ""  # whitespace the continued answer already ends with (not prefilled)
        self.parser = p.StreamParser(known_ids=set(planner.ids),
                                     first_action_number=len(planner.ids) + 1)
        self.text: list[str] = []
        self.usage: Usage | None = None
        self.deltas = 0
        self.wall_ends = job.begun_at + agent.max_wall_time_s  # time.time()
        self.check_at = 0.0
        self.next_check()

    def next_check(self) -> None:
        """When the turn's thread next looks at the job: in STATUS_CHECK_S, or when its wall
        time runs out if that is sooner."""
        now = time.monotonic()
        self.check_at = now + min(STATUS_CHECK_S, self.wall_ends - time.time())

    @property
    def lost(self) -> bool:
        """The job ended elsewhere (cancelled), or a write of this turn was refused (it was
        taken over while this process was paused): stop at once."""
        return self.job_ended.is_set() or fencing.is_lost(self.job_id, self.state.fence)

    def take(self, piece: Piece) -> list[p.ParseEvent] | None:
        if self.lost:  # before anything of the piece is handled
            return []
        if isinstance(piece, Usage):
            self.usage = piece
            return None
        self.deltas += 1
        if isinstance(piece, ToolCall):
            chunk = tool_call_to_protocol(dataclasses.replace(  # its tool's own name
                piece, name=self.names.get(piece.name, piece.name)))
            self.state.native.append((piece, chunk))  # as the model wrote it
        else:
            chunk = self._unskipped(piece.text)
            if not chunk:
                return None
            if self.keep_streamed:
                self.state.streamed.append(chunk)
        self.text.append(chunk)
        rest = handle(self.store, self.job_id, self.agent, self.planner,
                       self.parser.feed(chunk), self.state, self.depth, self.model, here=False)
        return [] if rest is None and time.monotonic() >= self.check_at else rest

    def replay(self, partial: str) -> str:
        """Take over a turn from its partial answer (what the coordinator that stopped had
        streamed and logged): feed it through the parser as if streamed, logging nothing again
        and registering only the actions the other had not (`start_action`). Returns the
        prefill that continues it: without trailing whitespace (Anthropic refuses it), which
        the continuation's first piece may then repeat (`skip`)."""
        self.text.append(partial)
        self.state.replaying = True
        try:
            handle(self.store, self.job_id, self.agent, self.planner, self.parser.feed(partial),
                   self.state, self.depth, self.model)
        finally:
            self.state.replaying = False
            self.state.batch, self.state.streamed = [], []
        prefill = partial.rstrip()
        self.skip = partial[len(prefill):]
        return prefill

    def _unskipped(self, text: str) -> str:
        """`text` without the whitespace the partial answer already had (`replay`)."""
        if not self.skip:
            return text
        same = 0
        while same < min(len(text), len(self.skip)) and text[same] == self.skip[same]:
            same += 1
        self.skip = self.skip[same:] if same == len(text) else ""
        return text[same:]


def handle(store: Store, job_id: str, agent: AgentSpec, planner: StreamPlanner,
            events: list[p.ParseEvent], state: Turn, depth: int, model: ModelConfig, *,
            here: bool = True) -> list[p.ParseEvent] | None:
    """Log parse events in order; register and dispatch each action as it closes. Outside
    the turn's thread (not `here`), stop at an action: the events from it on are returned,
    for the turn's thread (registering an action talks to Redis)."""
    for index, event in enumerate(events):
        if state.stopped_at is not None:
            return None
        if event.type == p.TEXT:
            state.plain.append(event.data["text"])
        elif event.type != p.WARNING:
            state.tagged = True
        if event.type == p.RESPONSE_END:
            state.responses.append({"final": event.data["final"], "text": event.data["text"]})
            state.final = state.final or event.data["final"]
        elif event.type == p.ACTION_PARSED:
            if not here:
                flush(store, job_id, state, force=False)
                return events[index:]
            action: Action = event.data["action"]
            cap = min(agent.max_actions, get_settings().max_actions_per_job)
            if len(planner.ids) >= cap:
                state.limit = f"max_actions ({cap}) reached: the agent wrote more actions than allowed"
                state.stopped_at = event.data["end"]
                break
            state.batch.append((p.ACTION_PARSED, {"action": action.model_dump(mode="json")}))
            flush(store, job_id, state)
            if not start_action(store, job_id, agent, planner, action, depth, model,
                                 retaken=state.retaken, fence=state.fence):
                state.ended = True  # the job ended: nothing more is registered or sent
                return None
            state.actions += 1
            if action.mode.value == "sync":
                state.stopped_at = event.data["end"]
        elif event.type in CHUNK_EVENTS:
            if event.type == p.PROTOCOL_ERROR:
                state.errors.append(event.data)
            state.batch.append((event.type, event.data))
    flush(store, job_id, state, force=False)
    return None


def flush(store: Store, job_id: str, state: Turn, *, force: bool = True) -> None:
    """Log the buffered events: now (`force`), or text chunks within FLUSH_S, together with
    every other turn's of this process (one Redis call per token, or per stream every
    FLUSH_S, would cost a worker more CPU than reading the streams)."""
    if state.replaying:  # logged by the coordinator that streamed it
        state.batch, state.streamed = [], []
        return
    writer = chunk_writer(store)
    streamed = "".join(state.streamed)
    if force:  # after the job's pending chunks; not past its end, nor past the turn's lease
        writer.flush(job_id, state.batch, state.fence, streamed)
    else:
        writer.add(job_id, state.batch, state.fence, streamed)
    state.batch, state.streamed = [], []


@cache
def chunk_writer(store: Store) -> ChunkWriter:
    return ChunkWriter(store, FLUSH_S, prepare=_coalesce, on_stale=fencing.turn_lost)


def _coalesce(batch: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    events = p.coalesce([p.ParseEvent(kind, data) for kind, data in batch])
    return [(e.type, e.data) for e in events]


def start_action(store: Store, job_id: str, agent: AgentSpec, planner: StreamPlanner,
                  action: Action, depth: int, model: ModelConfig, *, retaken: bool,
                  fence: int | None = None) -> bool:
    """Register the action and send it if it is ready; False if the job has ended. Fenced
    if the turn's `fence` is stale."""
    placed = planner.place(action)
    deps, after = list(placed.depends_on), list(placed.after)
    spec = action.model_dump(mode="json")
    spec.update(depends_on=deps, after=after, depth=depth, agent=agent.name)
    row = ACTION_TYPES[action.type.value]
    if row.needs_model:
        spec["model"] = model.wire()  # the job's model (option `model`)
    entry = {"id": action.id, "spec": dumps(spec), "deps": deps, "after": after,
             "on_error": action.on_error.value, "awaited": action.mode.value != "fire_and_forget"}
    refusal = row.grant(agent, action.name)  # nesting: jobs.lifecycle.submit_child
    if placed.self_loop:  # as a document says it: it could never run
        refusal = f"dependency cycle: {action.id} -> {action.id}"
    if refusal is not None:  # registered (dependents may wait on it), never queued
        entry.update(deps=[], after=[], hold=True)
    if retaken and store.spec(job_id, action.id) is not None:
        # Registered by an earlier generation of this turn, whose coordinator died: never
        # dispatch it again, unless it is still `queued` (it may have died before sending it;
        # a second delivery of a sent one is harmless: `claim` runs an action once).
        if refusal is None and store.action_status(job_id, action.id) == "queued":
            ready = [{"id": action.id}]
        else:
            return True
    else:
        registered = store.register(job_id, [entry], close=False, fence=fence)
        if not registered.recorded:
            return False
        ready = registered.ready
    if refusal is not None:
        executor.record_outcome(store, job_id, action.id, spec, "error", None, refusal,
                                fence=fence)
        return True
    if ready and row.in_turn:  # runs here, in the coordinator
        executor.execute(job_id, action.id, spec, trigger=True)
    elif ready:
        dispatch.send(job_id, [spec])
    return True


def fail_unseen_dependencies(store: Store, job_id: str, planner: StreamPlanner, state: Turn) -> None:
    for action_id, missing in list(planner.waiting.items()):
        message = (f"action {action_id!r} depends on {', '.join(map(repr, missing))}, which no "
                   "action of this job has")
        state.errors.append({"kind": "unknown_dependency", "message": message, "line": 0, "column": 0})
        state.batch.append((p.PROTOCOL_ERROR, {"kind": "unknown_dependency", "message": message,
                                               "line": 0, "column": 0, "action_id": action_id}))
        spec = {"id": action_id}
        executor.record_outcome(store, job_id, action_id, spec, "error", None, message,
                                fence=state.fence)
        del planner.waiting[action_id]


