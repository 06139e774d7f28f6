"""The agent loop (protocol.md §5): one task per turn, on the `agent` pool.

A turn streams the model through the parser, logs thought and response chunks as they arrive,
and registers and dispatches each action the moment its `</action>` closes. A sync action ends
the generation. The turn then closes its plan. The last of the turn's awaited actions to finish
sends the next turn (see `jobs.on_drained`), whose prompt carries their `<result>` blocks.

While the actions run, the turn's thread waits in place for them (`waiting`): the drain is
then published to this process instead of sent as a task. A turn that cannot wait, or has
waited long enough, returns and leaves its thread free. `reading` turns one generation's
stream into logged chunks and dispatched actions; this module runs the turns around it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import RedisError

from cortex_worker.actions import dispatch
from cortex_worker.agents import output
from cortex_worker.agents.prompt import (
    PROTOCOL_REMINDER,
    build_system_prompt,
    format_errors,
    format_feeds,
    format_results,
    result_body,
    tool_functions,
    tool_names,
)
from cortex_worker.agents.spec import AgentSpec
from cortex_worker.handles import get_job_ends, get_registry
from cortex_worker.jobs import feeds, lifecycle, tenants
from cortex_worker.jobs import usage as spending
from cortex_worker.jobs.ends import Watch
from cortex_worker.jobs.kinds import KINDS, render_responses
from cortex_worker.jobs.options import ClientTool
from cortex_worker.jobs.record import JobRecord
from cortex_worker.jobs.turns.reading import (
    Reading,
    Turn,
    chunk_writer,
    fail_unseen_dependencies,
    flush,
    handle,
)
from cortex_worker.jobs.turns.waiting import WaitSlot, waited
from cortex_worker.llm import limits
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.gateway import open_stream
from cortex_worker.llm.grammar import Grammar, build_grammar
from cortex_worker.llm.stream import (
    ModelError,
    estimate_usage,
    protocol_id,
)
from cortex_worker.observability import tracing
from cortex_worker.plan.stream import StreamPlanner
from cortex_worker.protocol import parser as p
from cortex_worker.protocol.events import EventType
from cortex_worker.recovery import fencing
from cortex_worker.recovery.liveness import is_dead
from cortex_worker.recovery.owners import owner
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Fenced, Resumed, Store, TurnInputs, TurnStart, dumps

log = logging.getLogger(__name__)

Closing = tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]
"""The last turn's closing events and the record's fields to write with them."""

MAX_REMINDERS = 3
TURN_RESTARTS = 1  # times a turn is generated again after its stream broke mid-output
TURN_LEASE_S = 30.0  # a turn whose owner has not renewed it this long may be taken over
RESULT_CHARS = 4000


def _resume(store: Store, job_id: str, start: TurnStart | None = None) -> Resumed | None:
    """Begin the next turn (and start it, with `start`, if the job agrees), or take over the
    turn in progress if its owner died (a process of this host that no longer exists) or its
    lease expired (another host)."""
    me = owner()
    resumed = store.resume(job_id, me, TURN_LEASE_S, start=start)
    if resumed is not None:
        return resumed
    current = (store.peek(job_id, "turn_owner") or JobRecord(id=job_id)).turn_owner
    if current and current != me and is_dead(store, current):
        return store.resume(job_id, me, TURN_LEASE_S, dead_owner=current)
    return None


def run_turns(store: Store, job_id: str) -> None:
    """Run the job's next turn(s) while nothing is left to wait for.

    A redelivered turn task (its coordinator was killed mid-turn) takes the turn over: it
    generates the turn again from the same prompt and planner state, skipping what the dead
    coordinator had already done (`turn_phase`), and never dispatching an action again that
    was already registered (see `start_action`). Every write of a turn carries its fence
    (`turn_fence`): a coordinator that was paused and wakes up to find its turn taken over
    writes nothing, and stops (`Fenced`)."""
    start: TurnStart | None = FIRST_TURN  # how the next turn starts, when this thread knows it
    if tenants.any_caps():
        job = store.peek(job_id, "status", "tenant", "parent_job")
        if job is not None and job.status == "queued" and not tenants.admitted(store, job):
            dispatch.agent_turn(job_id, countdown=tenants.ADMIT_AGAIN_S, start=True)  # the cap
            return
    while True:
        resumed, start = _resume(store, job_id, start), None
        if resumed is None:
            return
        turn, job, restarted = resumed.turn, resumed.job, resumed.restarted
        fence = job.turn_fence
        phase = job.turn_phase if restarted else "resumed"
        try:
            agent = get_registry().agent(job.agent or "")
        except Exception as exc:
            end_job(store, job_id, "failed", error=str(exc), turns=turn - 1, fence=fence)
            return
        partial = ""
        if restarted and phase != "yielded":  # handed back (`_hand_back`), not taken over
            partial = _taken_over(store, job_id, job, agent, turn, phase)
        try:
            closing: Closing = ([], {})
            if phase == "resumed" and resumed.inputs is None:
                closed = _close_previous_turn(store, job_id, job, agent, turn, fence)
                if closed is None:
                    return
                closing = closed
            job = job.model_copy(update=closing[1])  # what the turn's prompt reads of it
            with get_job_ends().watch(job_id) as pushed, WaitSlot() as slot:
                if phase == "generated":  # it died before it closed the turn's plan
                    drained = store.register(job_id, [], close=True, fence=fence).drained
                else:
                    with tracing.span(f"turn {turn}", job_id, {"cortex.job.id": job_id,
                                      "cortex.agent": agent.name, "cortex.turn": turn}), \
                            fencing.turn(job_id, fence):
                        turn_state = _generate(store, job_id, job, agent, turn,
                                               resumed.finished, closing, pushed, slot,
                                               restarted=restarted, inputs=resumed.inputs,
                                               partial=partial)
                    if turn_state is None:
                        return
                    drained = turn_state.drained
                if not drained and not (slot.waiter and waited(store, job_id, pushed, slot.waiter)):
                    return  # the last awaited action to finish sends the next turn
                if phase != "generated":
                    start = _known_start(job, agent, turn, turn_state)
        except Fenced as exc:  # the turn was taken over while this process was paused
            fencing.refused(exc)
            return
        except limits.ModelBusy as busy:
            _hand_back(store, job_id, turn, fence, busy)
            return
        except spending.QuotaExceeded as exc:
            end_job(store, job_id, "failed", error=str(exc), turns=turn, fence=fence)
            return
        except ModelError as exc:
            end_job(store, job_id, "failed", error=f"model error: {exc}", fence=fence)
            return
        except RedisError:
            # The store failed (redis-py retried): nothing can be recorded now. This process
            # lives on, so no reconciler takes the turn over: send it again for when our
            # lease has run out (`resume` then hands it over), and fail this task.
            log.exception("job %s: turn %s stopped: Redis failed; it is sent again in %g s",
                          job_id, turn, TURN_LEASE_S + 1)
            dispatch.agent_turn(job_id, countdown=TURN_LEASE_S + 1)
            raise
        except Exception as exc:  # a bug must end the job, never leave it running forever
            log.exception("job %s: turn %s failed", job_id, turn)
            end_job(store, job_id, "failed", turns=turn, fence=fence,
                    error=f"internal error in turn {turn}: {type(exc).__name__}: {exc}")
            return


def _taken_over(store: Store, job_id: str, job: JobRecord, agent: AgentSpec, turn: int,
                phase: str) -> str:
    """Say that the turn was taken over, and how it goes on; returns the partial answer to
    continue from ("" if it is generated again)."""
    log.warning("job %s: taking over turn %s (phase %s) from %s", job_id, turn, phase,
                job.turn_taken_from)
    model = KINDS["agent"].model(job) or agent.model
    partial = store.partial(job_id) if phase == "generating" and _continues(agent, model) else ""
    if partial:
        how = (f"it goes on from the {len(partial)} characters already streamed (the model "
               f"continues its partial answer: {model.continuation})")
    elif phase == "generated":
        how = "its answer was complete; its plan is closed now"
    else:
        how = ("it is generated again, so events of this turn already sent may repeat"
               + ("" if _continues(agent, model) else
                  " (set the model's `continuation` where its endpoint can continue a partial "
                  "answer)"))
    store.emit(job_id, [(EventType.warning, {
        "kind": "turn_restarted", "turn": turn, "continued": bool(partial),
        "message": f"turn {turn} was taken over from a coordinator that stopped "
                   f"({job.turn_taken_from}); {how}"})],
        fence=job.turn_fence)
    return partial


def _continues(agent: AgentSpec, model: ModelConfig) -> bool:
    """Whether a partial answer of this agent's turns can be continued: its endpoint says how
    (`continuation`), and the answer is protocol text (not native tool calls, which cannot be
    prefilled; not constrained by a grammar, whose state a prefill would not restore)."""
    return (model.continuation is not None and not agent.model.native_tools
            and model.grammar is None)


def _hand_back(store: Store, job_id: str, turn: int, fence: int, busy: limits.ModelBusy) -> None:
    """The model endpoint has no slot for longer than a thread is held: free the thread, and
    send the turn again for when a slot is due (it then takes the turn over and generates it
    from the same inputs). The turn's owner stays this process: if it dies first, the
    reconciler sends the turn at once."""
    if store.yield_turn(job_id, owner(), fence):
        log.info("job %s: turn %s waits %.1f s for model endpoint %s (%s) off its thread",
                 job_id, turn, busy.retry_in_s, busy.endpoint, busy.reason)
        dispatch.agent_turn(job_id, countdown=busy.retry_in_s)


FIRST_TURN = TurnStart(1, closing=[], fields={"pending_responses": [], "result": "",
                                              "turn_phase": "generating"},
                       begin=[(EventType.turn_started, {"turn": 1})])
"""How every job's first turn starts (no turn to close, no limit reached yet): `resume` logs
`job_started` with it."""


def _known_start(job: JobRecord, agent: AgentSpec, turn: int, state: Turn) -> TurnStart | None:
    """How the next turn starts, if this thread knows without reading anything: the turn it
    just ended left no responses to render and no final response, and no limit stops the
    job (as `_close_previous_turn` would find). `resume` checks the record agrees."""
    idle = state.actions == 0 and not state.final
    reminders = job.reminders + 1 if idle else 0
    if (state.responses or state.final or job.final or reminders >= MAX_REMINDERS
            or turn + 1 > agent.max_turns
            or time.time() - job.begun_at > agent.max_wall_time_s):
        return None
    return TurnStart(turn + 1, closing=[(EventType.turn_completed, {"turn": turn})],
                     fields={"pending_responses": [], "turn_phase": "generating"},
                     begin=[(EventType.turn_started, {"turn": turn + 1})])


def _close_previous_turn(store: Store, job_id: str, job: JobRecord, agent: AgentSpec,
                         turn: int, fence: int) -> Closing | None:
    """Render the last turn's responses and end the job if it is done (None). Otherwise the
    closing events and the record's fields, which the next turn writes as it starts."""
    events, final = render_responses(store, job_id, job.pending_responses)
    result = final or job.result or None
    if turn > 1:
        events.append((EventType.turn_completed, {"turn": turn - 1}))
    # logged as they are cleared, in one call (the next turn's start, or the job's end): a
    # coordinator that dies never loses them
    fields: dict[str, Any] = {"pending_responses": [], "result": result or ""}
    error = None
    typed: Any = None
    if job.final and agent.output_schema is not None:
        typed, problems = output.parse(result or "", agent.output_schema)
        if problems:  # refused: the model is told why, and answers again (if it may)
            why = output.rejection(problems)
            events.append((EventType.warning, {"kind": "output_rejected", "message": why,
                                               "answer": result}))
            if turn > agent.max_turns:
                error = f"max_turns ({agent.max_turns}) reached: {why}"
            else:
                return events, {**fields, "result": "", "final": False, "turn_phase": "generating",
                                 "feedback": [{"kind": "invalid_output", "message": why,
                                               "line": 0, "column": 0}]}
    if error is not None or job.final:
        pass
    elif job.reminders >= MAX_REMINDERS:
        error = f"{MAX_REMINDERS} turns in a row without an action or a final response"
    elif turn > agent.max_turns:
        error = f"max_turns ({agent.max_turns}) reached without a final response"
    elif time.time() - job.begun_at > agent.max_wall_time_s:
        error = f"wall time limit ({agent.max_wall_time_s:g} s) reached"
    else:
        return events, {**fields, "turn_phase": "generating"}
    ran = turn - 1  # `turn` is the one about to start; it never runs if the job ends here
    if error is None:
        end_job(store, job_id, "completed", result=result, turns=ran, closing=(events, fields),
                job=job, fence=fence, value=typed, typed=agent.output_schema is not None)
    else:
        end_job(store, job_id, "failed", error=error, turns=ran, closing=(events, fields),
                job=job, fence=fence)
    return None


def _stop_reason(store: Store, job_id: str, agent: AgentSpec, job: JobRecord, fence: int,
                 renew: bool = False) -> str | None:
    """Why a generation must stop now: "ended" (cancelled or failed elsewhere, or the turn
    was taken over by another coordinator: its fence moved on), the wall time limit, or None.
    `renew`: extend this coordinator's turn lease (only while the fence is its own)."""
    if renew:
        if not store.renew_turn(job_id, fence, TURN_LEASE_S):
            return "ended"
    else:
        current = store.peek(job_id, "status", "turn_fence")
        if current is None or current.ended or current.turn_fence != fence:
            return "ended"
    if time.time() - job.begun_at > agent.max_wall_time_s:
        return f"wall time limit ({agent.max_wall_time_s:g} s) reached"
    return None


def _prompt(store: Store, job_id: str, job: JobRecord, agent: AgentSpec, turn: int,
            finished: list[str], inputs: TurnInputs) -> tuple[list[dict[str, Any]], int]:
    """The turn's messages, and how many at the end are new (not yet in the conversation)."""
    parts: list[str] = []
    if turn == 1:
        parts.append(job.input)
    native = {c["action_id"]: c["id"] for c in job.native_calls}
    records = inputs.results
    results = {a: {"id": a, "status": r["status"], "value": r.get("value")} if r["status"] == "ok"
               else {"id": a, "status": r["status"], "error": r.get("error")}
               for a, r in records.items()}
    # a native call's result is a `tool` message answering it, in call order (as the model
    # was trained); every other action's is a <result> block
    tool_messages = [{"role": "tool", "tool_call_id": call_id,
                      "content": _tool_content(results.get(action_id), RESULT_CHARS)}
                     for action_id, call_id in native.items()]
    blocks = [results[a] for a in finished if a in results and a not in native]
    if blocks:
        parts.append(format_results(blocks, RESULT_CHARS))
    if job.feedback:
        parts.append(format_errors(job.feedback))
    if job.remind:
        parts.append(PROTOCOL_REMINDER)
    context = feeds.current_values(store, job_id, agent.name, inputs.feed_changes)
    if context:
        parts.append(format_feeds(context))
    system = build_system_prompt(agent, get_registry(), job.options.client_tools)
    text = "\n\n".join(x for x in parts if x)
    user = [{"role": "user", "content": text or PROTOCOL_REMINDER}] if text or not tool_messages else []
    fresh = [*tool_messages, *user]  # appended to the conversation with the turn's reply
    return [{"role": "system", "content": system}, *inputs.conversation, *fresh], len(fresh)


def _tool_content(result: dict[str, Any] | None, limit: int) -> str:
    """The `tool` message of a native call: its value, or `<status>: <error>`."""
    if result is None:
        return "error: this call did not run (see the protocol errors in the next message)"
    body = result_body(result, limit)
    return body if result["status"] == "ok" else f"{result['status']}: {body}"


def model_caller(store: Store, job_id: str, job: JobRecord, agent: AgentSpec,
                 fence: int | None = None) -> limits.Caller:
    """The job as a caller of its model endpoint: it waits for a shared slot until its wall
    time runs out, its log shows each wait (`model_waiting`), and each request is counted
    against its tenant's budget (`usage`)."""
    def waiting(endpoint: str, reason: str, wait_s: float | None) -> None:
        store.emit(job_id, [(EventType.model_waiting, {
            "endpoint": endpoint, "reason": reason,
            "wait_s": None if wait_s is None else round(wait_s, 3)})], live=True, fence=fence)
    def spent(endpoint: str, prompt_tokens: int, completion_tokens: int) -> None:
        spending.record(store, job_id, job.tenant, endpoint, prompt_tokens, completion_tokens)

    return limits.Caller(store, job_id, job.tenant, on_wait=waiting,
                         deadline=job.begun_at + agent.max_wall_time_s, hold_s=limits.HOLD_S,
                         before=lambda: spending.check_running(store, job.tenant), on_usage=spent)


def _generate(store: Store, job_id: str, job: JobRecord, agent: AgentSpec, turn: int,
              finished: list[str], closing: Closing, pushed: Watch, slot: WaitSlot,
              restarted: bool = False, inputs: TurnInputs | None = None,
              partial: str = "") -> Turn | None:
    """Generate one turn; `inputs`: its start, if `resume` made it already (`TurnStart`).
    Every write carries the turn's fence (`job.turn_fence`). `partial`: the answer a
    coordinator that stopped had streamed, which this one continues (`_taken_over`); a stream
    that breaks mid-answer is continued the same way where the model can."""
    fence = job.turn_fence
    if inputs is None:
        begin: list[tuple[str, dict[str, Any]]] = []
        if not restarted:
            first = [(EventType.job_started, {"kind": "agent", "agent": agent.name})] if turn == 1 else []
            begin = [*first, (EventType.turn_started, {"turn": turn})]
        inputs = store.start_turn(job_id, closing=closing[0], fields=closing[1], begin=begin,
                                  action_ids=[*(c["action_id"] for c in job.native_calls),
                                              *finished], fence=fence)
    if not inputs.begun:
        return None  # it ended (cancelled) before this turn began
    messages, fresh = _prompt(store, job_id, job, agent, turn, finished, inputs)
    planner = StreamPlanner.from_json(job.planner)
    client = job.options.client_tools
    tools = tool_functions(agent, get_registry(), client) if agent.model.native_tools else None
    names = tool_names(agent, client)
    model = _acting(KINDS["agent"].model(job) or agent.model, planner)
    grammar = _grammar(agent, model, client)
    depth = job.depth
    # the job's client tools are granted like the manifest's tools (`tool.grant`)
    granting = agent.model_copy(update={"tools": [*agent.tools, *job.options.client_tool_names()]}) \
        if client else agent
    continues = _continues(agent, model)
    # a tool-calling model answers in plain text (its result): the provider holds it to the
    # schema; in protocol text the grammar does (the final response), or nothing but the check
    typed = agent.output_schema if tools and grammar is None else None
    with limits.calling(model_caller(store, job_id, job, agent, fence)):
        for restart in range(TURN_RESTARTS + 1):
            reading = Reading(store, job_id, job, granting, planner, depth, model, names, pushed.ended,
                              retaken=restarted or bool(partial), fence=fence,
                              keep_streamed=continues)
            state = reading.state
            request = messages
            if partial:  # go on from the answer streamed so far, as logged
                request = [*messages, {"role": "assistant", "content": reading.replay(partial)}]
            # ended before the stream opened? (just seen not to have, if this turn began now)
            if (restart or restarted) and _stop_reason(store, job_id, agent, job, fence):
                state.ended = True
                break
            if state.stopped_at is not None or state.ended or state.limit is not None:
                break  # the partial answer stops here already (a sync action, a limit)
            stream = open_stream(model, request, tools=tools, base_dir=get_settings().manifests,
                                 grammar=grammar, take=reading.take,
                                 output_schema=typed if isinstance(typed, dict) else None)
            try:
                for events in stream:  # only when this thread has something to do
                    if reading.lost:
                        state.ended = True
                        break
                    if time.monotonic() >= reading.check_at:  # out of time, or a missed end?
                        reading.next_check()
                        if _stop_reason(store, job_id, agent, job, fence, renew=True):
                            state.ended = True
                            break
                    handle(store, job_id, granting, planner, events, state, depth, model)
                    if state.stopped_at is not None or state.ended:
                        break
            except ModelError as exc:
                # A failure before the first piece was retried by the gateway (max_retries);
                # a stream that broke after output arrived restarts the turn, TURN_RESTARTS times.
                if reading.deltas and exc.retryable and state.actions == 0 and restart < TURN_RESTARTS:
                    flush(store, job_id, state)
                    if continues:
                        partial = "".join(reading.text)
                    store.emit(job_id, [(EventType.warning, {
                        "kind": "model_retry", "continued": continues,
                        "message": f"the model stream broke ({exc}); turn " + (
                            "continued from the text streamed" if continues else "restarted")})],
                        live=True, fence=fence)
                    continue
                if restart:
                    exc.message += f"; the turn was restarted {restart} time(s) after its stream broke"
                    exc.args = (exc.message,)
                raise
            finally:
                close = getattr(stream, "close", None)
                if close:
                    close()
            break
    parser, text, usage, deltas = reading.parser, reading.text, reading.usage, reading.deltas
    if state.ended:
        if fencing.is_lost(job_id, fence):
            raise Fenced("turn", job_id, f"turn fence {fence}")
        flush(store, job_id, state)
        reason = _stop_reason(store, job_id, agent, job, fence)
        if reason and reason != "ended":
            end_job(store, job_id, "failed", error=reason, turns=turn, fence=fence)
        return None
    tail = parser.close()
    if state.stopped_at is not None:  # we cut the stream: open blocks are not the model's fault
        tail = [e for e in tail if not (e.type == p.PROTOCOL_ERROR and e.data["kind"] == "unclosed_block")]
    handle(store, job_id, granting, planner, tail, state, depth, model)
    if state.ended:
        return None
    fail_unseen_dependencies(store, job_id, planner, state)
    if state.limit is not None:
        flush(store, job_id, state)
        end_job(store, job_id, "failed", error=state.limit, turns=turn, fence=fence)
        return None

    generated = "".join(text)
    if state.stopped_at is not None:
        generated = generated[:state.stopped_at]
    native = [call for call, chunk in state.native if chunk in generated]  # not cut by a sync stop
    for chunk in [chunk for _, chunk in state.native]:
        generated = generated.replace(chunk, "", 1)  # they go in `tool_calls`, as sent
    answer = "".join(state.plain).strip()
    if agent.model.native_tools and not state.tagged and state.actions == 0 and answer:
        # a tool-calling model finishes by answering in plain text: that is the job's result
        state.final = True
        state.responses.append({"final": True, "text": answer})
    assistant: dict[str, Any] = {"role": "assistant", "content": generated or None}
    if native:
        assistant["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.raw_arguments or dumps(c.arguments or {})}}
            for c in native]
    elif assistant["content"] is None:
        assistant["content"] = ""
    idle = state.actions == 0 and not state.final
    fields: dict[str, Any] = {
        "native_calls": [{"id": c.id, "action_id": protocol_id(c.id)} for c in native],
        "planner": planner.to_json(), "pending_responses": state.responses,
        "final": state.final or job.final,
        "feedback": [{k: e[k] for k in ("kind", "message", "line", "column")} for e in state.errors],
        "remind": idle,
        "reminders": job.reminders + 1 if idle else 0,
        "turn_phase": "generated",
    }
    estimated = usage is None and state.stopped_at is not None
    if estimated:  # we closed the stream before the endpoint sent its counts
        usage = estimate_usage(messages, deltas)
    events: list[tuple[str, dict[str, Any]]] = []
    if usage is not None:
        fields["prompt_tokens"] = job.prompt_tokens + usage.prompt_tokens
        fields["completion_tokens"] = job.completion_tokens + usage.completion_tokens
        events.append((EventType.usage, {"turn": turn, "prompt_tokens": usage.prompt_tokens,
                                 "completion_tokens": usage.completion_tokens,
                                 **({"estimated": True} if estimated else {})}))
    with chunk_writer(store).taken(job_id, state.batch, fence) as chunks:  # logged with the end
        state.batch = []
        state.drained = store.end_turn(job_id, [*messages[len(messages) - fresh:], assistant],
                                       fields, events, waiter=slot.take(), chunks=chunks,
                                       fence=fence)
    return state


def _acting(model: ModelConfig, planner: StreamPlanner) -> ModelConfig:
    """The model as this turn asks it: `tool_choice: required` (or a tool's name) holds until
    the job has run an action (its planner has placed one), then it is `auto`, so the model
    can answer (the OpenAI Agents SDK's reset_tool_choice)."""
    if model.tool_choice not in ("auto", "none") and planner.ids:
        return model.model_copy(update={"tool_choice": "auto"})
    return model


_grammars: dict[tuple[str, str, str, str], Grammar | None] = {}


def _grammar(agent: AgentSpec, model: ModelConfig,
             client: list[ClientTool]) -> Grammar | None:
    """The agent's protocol grammar in its model's flavour (`model.grammar`) for the turn's
    tool choice and the job's client tools, built once per process (the registry does not
    change while it runs; a frontend sends the same client tools run after run)."""
    if model.grammar is None:
        return None
    key = (agent.name, model.grammar, model.tool_choice,
           dumps([tool.model_dump() for tool in client]))
    if key not in _grammars:
        _grammars[key] = build_grammar(agent, get_registry(), model.grammar,
                                       tool_choice=model.tool_choice, client_tools=client)
    return _grammars[key]


def end_job(store: Store, job_id: str, status: str, *, result: str | None = None,
            error: str | None = None, turns: int | None = None,
            closing: Closing = ([], {}), job: JobRecord | None = None,
            fence: int | None = None, value: Any = None, typed: bool = False) -> None:
    """End an agent job (through `jobs.end_job`). `turns`: how many turns ran (default: the
    job's turn counter, which counts a turn as it begins). `closing`: the last turn's closing
    events and fields, logged and written with the end. `job`: its record, just read.
    `fence`: the ending turn's (a turn taken over does not end its job). `typed`: the job's
    result is `value`, its final response read against the agent's `output_schema` (kept as
    JSON text in the record, `result_type: json`)."""
    if turns is None:
        turns = (store.peek(job_id, "turn") or JobRecord(id=job_id)).turn
    events, fields = closing
    final = value if typed else result
    lifecycle.end_job(store, job_id, status, {"status": status, "result": final, "error": error,
                                         "turns": turns},
                 {**fields, "result": dumps(value) if typed else result or "",
                  "result_type": "json" if typed else "", "error": error or "", "turns": turns},
                 events=events, result=final, job=job, fence=fence)
