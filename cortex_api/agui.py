"""A job's events as AG-UI events (`GET /v1/jobs/{id}/events?format=ag-ui`).

`AgUiTranslator` is one stream's translation: call it with each Cortex event in seq order and
it returns the AG-UI events (dicts, camelCase keys as on the wire) that event becomes: none,
one or several. `HANDLERS` maps each Cortex event type to its handler; a type with no AG-UI
equivalent becomes a `CUSTOM` event named `cortex.<type>` whose value is the event's data.

Its state (which reasoning and text messages are open, the open turn step, the token counts)
is a function of the events before, and every id is derived from the job id and the event
that opened the thing it names: a stream resuming after seq N runs a fresh translator over
events 1..N, discards what it returns, and then writes exactly what an unbroken stream would
have written after N. The module does no I/O and does not import `ag_ui`: the package checks
the shapes in the tests only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cortex_worker.protocol.events import ACTION_END_EVENTS, TERMINAL_EVENTS, EventType

Event = dict[str, Any]
AgUi = dict[str, Any]

#: Warnings that mean the turn's model stream starts over: what it streamed is closed (unless
#: the warning says the stream was `continued` from what it had streamed: it goes on).
RESTARTS = frozenset({"model_retry", "turn_restarted"})
#: Parse events that end a run of `response_chunk`s: the next chunk is another response.
RESPONSE_BREAKS = frozenset({EventType.text, EventType.thought_chunk, EventType.thought_end,
                             EventType.action_parsed, EventType.context_feed,
                             EventType.response_end})


@dataclass(slots=True)
class _Response:
    """A response streamed as a text message, waiting for its rendered text (`response_end`).

    Text is sent up to the first `$` as it arrives; the rest may hold references, which only
    the rendered text resolves, so it is held back until then."""

    message_id: str
    final: bool
    written: str = ""
    sent: str = ""

    def add(self, text: str) -> str:
        """Take a chunk; returns what can be sent now."""
        self.written += text
        cut = self.written.find("$")
        visible = self.written if cut < 0 else self.written[:cut]
        delta, self.sent = visible[len(self.sent):], visible
        return delta


class AgUiTranslator:
    """Cortex events of one job, in seq order, to AG-UI events; state per stream."""

    def __init__(self, job_id: str, thread_id: str | None = None,
                 run_id: str | None = None) -> None:
        self.job_id = job_id
        self.thread_id = thread_id or job_id
        self.run_id = run_id or job_id
        self._thought: str | None = None  # the open reasoning message
        self._responses: list[_Response] = []  # open text messages, oldest first
        self._streaming: _Response | None = None  # the one chunks go to
        self._step: str | None = None  # the open turn
        self._calls: set[str] = set()  # action ids whose tool call was sent
        self._tokens = [0, 0]  # prompt, completion

    def __call__(self, event: Event) -> list[AgUi]:
        kind = str(event["type"])
        if kind in RESPONSE_BREAKS:
            self._streaming = None
        out = HANDLERS.get(kind, AgUiTranslator._custom)(self, event)
        stamp = round(float(event["ts"]) * 1000)
        return [{**item, "timestamp": stamp} for item in out]

    # -- ids: the same in every stream of the job -----------------------------------------
    def _id(self, kind: str, event: Event) -> str:
        return f"{self.job_id}:{kind}:{event['seq']}"

    def call_id(self, action_id: str) -> str:
        """The tool call id of an action, in every stream of the job."""
        return f"{self.job_id}:{action_id}"

    # -- run and turns --------------------------------------------------------------------
    def _run_started(self, event: Event) -> list[AgUi]:
        started: AgUi = {"type": "RUN_STARTED", "threadId": self.thread_id, "runId": self.run_id,
                         "rawEvent": event}
        if event["data"].get("parent_job"):
            started["parentRunId"] = event["data"]["parent_job"]
        return [started]

    def _turn_started(self, event: Event) -> list[AgUi]:
        out = self._turn_completed(event)  # a turn is only ever open one at a time
        self._step = f"turn {event['data']['turn']}"
        return [*out, {"type": "STEP_STARTED", "stepName": self._step}]

    def _turn_completed(self, event: Event) -> list[AgUi]:
        return self._close_messages() + self._close_step()

    def _usage(self, event: Event) -> list[AgUi]:
        self._tokens[0] += int(event["data"].get("prompt_tokens") or 0)
        self._tokens[1] += int(event["data"].get("completion_tokens") or 0)
        return self._custom(event)

    def _job_completed(self, event: Event) -> list[AgUi]:
        return self._finish(event, {"type": "RUN_FINISHED", "threadId": self.thread_id,
                                    "runId": self.run_id, "result": event["data"].get("result")})

    def _job_failed(self, event: Event) -> list[AgUi]:
        data = event["data"]
        return self._finish(event, {"type": "RUN_ERROR", "code": "job_failed",
                                    "message": data.get("error") or data.get("reason") or "failed"})

    def _job_cancelled(self, event: Event) -> list[AgUi]:
        return self._finish(event, {"type": "RUN_FINISHED", "threadId": self.thread_id,
                                    "runId": self.run_id, "outcome": {"type": "cancelled"}})

    def interrupted(self, event: Event, interrupts: list[AgUi]) -> list[AgUi]:
        """The run ends at `event` because the job waits for people: close what is open, then
        RUN_FINISHED with the interrupt outcome; with no interrupt (it waits only for the
        client's frontend tools), a plain RUN_FINISHED: the client runs the tool calls it
        was sent, as after any run, and answers them in the next."""
        last: AgUi = {"type": "RUN_FINISHED", "threadId": self.thread_id, "runId": self.run_id}
        if interrupts:
            last["outcome"] = {"type": "interrupt", "interrupts": interrupts}
        return self._finish(event, last)

    def reset_usage(self) -> None:
        """A run that goes on after an interrupt reports only the model calls it made itself."""
        self._tokens = [0, 0]

    def reopen(self) -> list[AgUi]:
        """START events of what is open now: how a stream joining mid-run goes on after its
        RUN_STARTED (ids as before: the client already holds these messages)."""
        out: list[AgUi] = []
        if self._step is not None:
            out.append({"type": "STEP_STARTED", "stepName": self._step})
        if self._thought is not None:
            out += [{"type": "REASONING_START", "messageId": self._thought},
                    {"type": "REASONING_MESSAGE_START", "messageId": self._thought,
                     "role": "reasoning"}]
        out += [{"type": "TEXT_MESSAGE_START", "messageId": response.message_id,
                 "role": "assistant"} for response in self._responses]
        return out

    def called(self, action_id: str) -> str | None:
        """The tool call id of an action whose call was sent, else None."""
        return self.call_id(action_id) if action_id in self._calls else None

    def _finish(self, event: Event, last: AgUi) -> list[AgUi]:
        """Close what is open, then the run: RUN_FINISHED / RUN_ERROR comes last."""
        if any(self._tokens):
            prompt, completion = self._tokens
            last["usage"] = [{"inputTokens": prompt, "outputTokens": completion,
                              "totalTokens": prompt + completion}]
        return [*self._close_messages(), *self._close_step(), {**last, "rawEvent": event}]

    # -- thoughts: reasoning messages -----------------------------------------------------
    def _thought_chunk(self, event: Event) -> list[AgUi]:
        out = [] if self._thought is not None else self._open_thought(event)
        return [*out, {"type": "REASONING_MESSAGE_CONTENT", "messageId": self._thought,
                       "delta": event["data"]["text"]}]

    def _thought_end(self, event: Event) -> list[AgUi]:
        if self._thought is not None:
            return self._close_thought()
        text = event["data"]["text"]  # nothing streamed: the whole thought at once
        out = self._open_thought(event)
        if text:
            out.append({"type": "REASONING_MESSAGE_CONTENT", "messageId": self._thought,
                        "delta": text})
        return out + self._close_thought()

    def _open_thought(self, event: Event) -> list[AgUi]:
        self._thought = self._id("thought", event)
        return [{"type": "REASONING_START", "messageId": self._thought},
                {"type": "REASONING_MESSAGE_START", "messageId": self._thought,
                 "role": "reasoning"}]

    def _close_thought(self) -> list[AgUi]:
        if self._thought is None:
            return []
        message, self._thought = self._thought, None
        return [{"type": "REASONING_MESSAGE_END", "messageId": message},
                {"type": "REASONING_END", "messageId": message}]

    # -- responses: assistant text messages -----------------------------------------------
    def _response_chunk(self, event: Event) -> list[AgUi]:
        data = event["data"]
        out: list[AgUi] = []
        response = self._streaming
        if response is None or response.final != bool(data.get("final")):
            response = _Response(self._id("response", event), bool(data.get("final")))
            self._responses.append(response)
            out.append({"type": "TEXT_MESSAGE_START", "messageId": response.message_id,
                        "role": "assistant"})
        self._streaming = response
        delta = response.add(data["text"])
        if delta:
            out.append({"type": "TEXT_MESSAGE_CONTENT", "messageId": response.message_id,
                        "delta": delta})
        return out

    def _response_end(self, event: Event) -> list[AgUi]:
        """The rendered text completes the oldest open response that it continues; with none
        (a plain-text answer, never streamed), it is a message of its own."""
        text = event["data"]["text"]
        out: list[AgUi] = []
        response = self._responses.pop(0) if self._responses else None
        if response is not None and not text.startswith(response.sent):
            out += self._end_response(response)  # not its text after all: keep both
            response = None
        if response is None:
            response = _Response(self._id("response", event), bool(event["data"].get("final")))
            out.append({"type": "TEXT_MESSAGE_START", "messageId": response.message_id,
                        "role": "assistant"})
        if text[len(response.sent):]:
            out.append({"type": "TEXT_MESSAGE_CONTENT", "messageId": response.message_id,
                        "delta": text[len(response.sent):]})
        return [*out, {"type": "TEXT_MESSAGE_END", "messageId": response.message_id,
                       "rawEvent": event}]

    def _end_response(self, response: _Response) -> list[AgUi]:
        """End a response that will not be rendered: what was held back is sent as written."""
        held = response.written[len(response.sent):]
        content = [{"type": "TEXT_MESSAGE_CONTENT", "messageId": response.message_id,
                    "delta": held}] if held else []
        return [*content, {"type": "TEXT_MESSAGE_END", "messageId": response.message_id}]

    def _close_messages(self) -> list[AgUi]:
        """The turn's stream is over (or starts again): close its open messages."""
        out = self._close_thought()
        for response in self._responses:
            out += self._end_response(response)
        self._responses, self._streaming = [], None
        return out

    def _close_step(self) -> list[AgUi]:
        if self._step is None:
            return []
        step, self._step = self._step, None
        return [{"type": "STEP_FINISHED", "stepName": step}]

    def _warning(self, event: Event) -> list[AgUi]:
        data = event["data"]
        over = data.get("kind") in RESTARTS and not data.get("continued")  # continued: it goes on
        closed = self._close_messages() if over else []
        return closed + self._custom(event)

    # -- actions: tool calls --------------------------------------------------------------
    def _action_parsed(self, event: Event) -> list[AgUi]:
        action = event["data"]["action"]
        if action["id"] in self._calls:  # a taken-over turn parses it again: one call only
            return self._custom(event)
        self._calls.add(action["id"])
        call = self.call_id(action["id"])
        return [{"type": "TOOL_CALL_START", "toolCallId": call, "toolCallName": action["name"],
                 "rawEvent": event},
                {"type": "TOOL_CALL_ARGS", "toolCallId": call,
                 "delta": json.dumps(action.get("parameters") or {}, ensure_ascii=False)},
                {"type": "TOOL_CALL_END", "toolCallId": call}]

    def _action_completed(self, event: Event) -> list[AgUi]:
        result = event["data"].get("result")
        return self._result(event, result if isinstance(result, str) else
                            json.dumps(result, ensure_ascii=False))

    def _action_failed(self, event: Event) -> list[AgUi]:
        data = event["data"]
        error = data.get("error")
        text = error if isinstance(error, str) else json.dumps(error, ensure_ascii=False)
        return self._result(event, f"{data['status']}: {text}")

    def _action_skipped(self, event: Event) -> list[AgUi]:
        return self._result(event, f"skipped: {event['data'].get('reason', '')}")

    def _action_cancelled(self, event: Event) -> list[AgUi]:
        return self._result(event, "cancelled: the job ended first")

    def _result(self, event: Event, content: str) -> list[AgUi]:
        """The action's outcome, as the model reads it, answers its tool call."""
        action_id = event["data"]["action_id"]
        return [{"type": "TOOL_CALL_RESULT", "messageId": f"{self.call_id(action_id)}:result",
                 "toolCallId": self.call_id(action_id), "role": "tool", "content": content,
                 "rawEvent": event}]

    # -- the rest -------------------------------------------------------------------------
    def _custom(self, event: Event) -> list[AgUi]:
        return [{"type": "CUSTOM", "name": f"cortex.{event['type']}", "value": event["data"]}]


Handler = Callable[[AgUiTranslator, Event], list[AgUi]]

#: Cortex event type -> handler. Types not listed (`job_started`, `text`, `context_feed`,
#: `feed_updated`, `protocol_error`, `child_job`, `action_queued`, `action_started`,
#: `action_retrying`, `approval_requested`, `action_approved`, `action_rejected`, and any
#: type added later) become `CUSTOM` events.
HANDLERS: dict[str, Handler] = {
    EventType.job_queued: AgUiTranslator._run_started,
    EventType.turn_started: AgUiTranslator._turn_started,
    EventType.turn_completed: AgUiTranslator._turn_completed,
    EventType.usage: AgUiTranslator._usage,
    EventType.job_completed: AgUiTranslator._job_completed,
    EventType.job_failed: AgUiTranslator._job_failed,
    EventType.job_cancelled: AgUiTranslator._job_cancelled,
    EventType.thought_chunk: AgUiTranslator._thought_chunk,
    EventType.thought_end: AgUiTranslator._thought_end,
    EventType.response_chunk: AgUiTranslator._response_chunk,
    EventType.response_end: AgUiTranslator._response_end,
    EventType.warning: AgUiTranslator._warning,
    EventType.action_parsed: AgUiTranslator._action_parsed,
    EventType.action_completed: AgUiTranslator._action_completed,
    EventType.action_failed: AgUiTranslator._action_failed,
    EventType.action_skipped: AgUiTranslator._action_skipped,
    EventType.action_cancelled: AgUiTranslator._action_cancelled,
}

#: What an approval interrupt expects back (`RunAgentInput.resume[].payload`): AG-UI's
#: tool-approval shape; a `reason` goes with a rejection.
APPROVAL_SCHEMA: AgUi = {
    "type": "object",
    "properties": {"approved": {"type": "boolean"},
                   "reason": {"type": "string", "description": "why, if rejected"}},
    "required": ["approved"],
}


def interrupt_id(job_id: str, action_id: str) -> str:
    """The id of the interrupt that asks for an action's approval."""
    return f"{job_id}:{action_id}:approval"


class AgUiRun:
    """One run of `POST /v1/agents/{name}/ag-ui`: the events of its job after seq `start`,
    under the client's thread and run ids. It ends with the job, or at seq `until`, where the
    job began to wait for people: RUN_FINISHED then carries an interrupt per approval awaited.
    A call of a client tool (`JobOptions.client_tools`: an AG-UI frontend tool) is held like
    an approval, but is no interrupt: the run ends with its TOOL_CALL_* events, and the
    client's answer in the next run is its result (the client holds that message already: it
    gets no TOOL_CALL_RESULT for it).

    `seen` takes the events the client already has (up to where its stream joins); calls
    return (SSE id, AG-UI event) pairs: a stream that joins after the job's first event
    begins with RUN_STARTED, the `cortex.run` event and the START of what is open, under the
    id of the join point, so AG-UI's verifier accepts it."""

    def __init__(self, job_id: str, thread_id: str, run_id: str, *, session_id: str,
                 start: int = 0, until: int | None = None) -> None:
        self.translate = AgUiTranslator(job_id, thread_id, run_id)
        self.session_id = session_id
        self.start = start
        self.until = until
        self.seq = 0  # the last event taken
        self.ended = False
        self._joined = False
        self._last: Event | None = None
        self._awaiting: dict[str, Event] = {}  # action id -> its approval_requested
        self._client: set[str] = set()  # action ids of client tool calls

    @property
    def awaiting(self) -> bool:
        """Whether an approval is awaited now (the run may be about to pause)."""
        return bool(self._awaiting)

    def seen(self, event: Event) -> None:
        """An event before the join point: state only."""
        self._take(event)

    def __call__(self, event: Event) -> list[tuple[int, AgUi]]:
        if self.ended:
            return []
        head: list[AgUi] = []
        if not self._joined and event["type"] != EventType.job_queued:
            head = [self._started(), self._job(), *self.translate.reopen()]
        joined_at = self.seq
        out = self._take(event)
        if not self._joined and out and out[0]["type"] == "RUN_STARTED":
            out.insert(1, self._job())
        self._joined = True
        return [(joined_at, item) for item in head] + [(self.seq, item) for item in out]

    def pause(self, until: int) -> list[tuple[int, AgUi]]:
        """The job began to wait for people at seq `until`: the run ends there (now, if its
        stream is past it)."""
        self.until = until
        if self.ended or self._last is None or self.seq < until or not self._awaiting:
            return []
        self.ended = True
        return [(self.seq, item) for item in self.translate.interrupted(self._last,
                                                                        self.interrupts())]

    def interrupts(self) -> list[AgUi]:
        """The interrupts of the approvals awaited now (AG-UI `Interrupt`s)."""
        job_id = self.translate.job_id
        out: list[AgUi] = []
        for action_id, event in self._awaiting.items():
            data = event["data"]
            if data.get("client"):
                continue
            shown = json.dumps(data.get("parameters") or {}, ensure_ascii=False)
            interrupt: AgUi = {
                "id": interrupt_id(job_id, action_id), "reason": "confirmation",
                "message": f"Approve {data.get('type', 'tool')} {data.get('name')!r} with {shown}?",
                "responseSchema": APPROVAL_SCHEMA,
                "metadata": {"cortex": {"jobId": job_id, "actionId": action_id,
                                        "type": data.get("type"), "name": data.get("name"),
                                        "parameters": data.get("parameters")}}}
            call = self.translate.called(action_id)
            if call is not None:
                interrupt.update(reason="tool_call", toolCallId=call)
            if data.get("expires_at") is not None:
                interrupt["expiresAt"] = datetime.fromtimestamp(
                    float(data["expires_at"]), UTC).isoformat().replace("+00:00", "Z")
            out.append(interrupt)
        return out

    def client_calls(self) -> dict[str, str]:
        """The client tool calls awaited now: tool call id -> action id."""
        return {self.translate.call_id(action_id): action_id
                for action_id, event in self._awaiting.items() if event["data"].get("client")}

    def _take(self, event: Event) -> list[AgUi]:
        """Translate an event, follow the approvals, and end the run where it ends."""
        seq, kind = int(event["seq"]), str(event["type"])
        self.seq, self._last = seq, event
        data = event["data"]
        if kind == EventType.approval_requested:
            self._awaiting[data["action_id"]] = event
            if data.get("client"):
                self._client.add(data["action_id"])
        elif kind in (EventType.action_approved, EventType.action_rejected) \
                or kind in ACTION_END_EVENTS:
            self._awaiting.pop(data.get("action_id", ""), None)
        out = self.translate(event)
        if kind == EventType.action_completed and data["action_id"] in self._client:
            out = [item for item in out if item["type"] != "TOOL_CALL_RESULT"]
        if seq == self.start and seq > 0:
            self.translate.reset_usage()
        if kind in TERMINAL_EVENTS:
            self.ended = True
        elif self.until is not None and seq >= self.until and self._awaiting:
            out += self.translate.interrupted(event, self.interrupts())
            self.ended = True
        return out

    def _started(self) -> AgUi:
        translate = self.translate
        return {"type": "RUN_STARTED", "threadId": translate.thread_id,
                "runId": translate.run_id}

    def _job(self) -> AgUi:
        """The Cortex ids of the run, for a client that wants the job's own API."""
        return {"type": "CUSTOM", "name": "cortex.run",
                "value": {"jobId": self.translate.job_id, "sessionId": self.session_id}}
