"""A Cortex agent job seen as an A2A task: its `Task`, and the updates its events mean.

A task IS the job (same id) and its `contextId` IS the job's session; nothing here is stored:
every `Task` is read from the job record, every update from the job's event log.
"""

from __future__ import annotations

import json
from typing import Any

from a2a.types.a2a_pb2 import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import ContentTypeNotSupportedError, InvalidParamsError
from google.protobuf.json_format import MessageToDict
from google.protobuf.timestamp_pb2 import Timestamp

from cortex_worker.jobs.record import JobRecord
from cortex_worker.protocol.events import EventType, JobStatus

#: A job's status as an A2A task state.
STATES: dict[str, TaskState.ValueType] = {
    JobStatus.queued: TaskState.TASK_STATE_SUBMITTED,
    JobStatus.running: TaskState.TASK_STATE_WORKING,
    JobStatus.finishing: TaskState.TASK_STATE_WORKING,
    JobStatus.completed: TaskState.TASK_STATE_COMPLETED,
    JobStatus.failed: TaskState.TASK_STATE_FAILED,
    JobStatus.cancelled: TaskState.TASK_STATE_CANCELED,
}
#: The end event of a job, as the final state of its task.
END_STATES: dict[str, TaskState.ValueType] = {
    EventType.job_completed: TaskState.TASK_STATE_COMPLETED,
    EventType.job_failed: TaskState.TASK_STATE_FAILED,
    EventType.job_cancelled: TaskState.TASK_STATE_CANCELED,
}
#: The artifact that carries the agent's final response.
RESPONSE_ARTIFACT = "response"

Update = TaskStatusUpdateEvent | TaskArtifactUpdateEvent


def message_text(message: Message) -> str:
    """The text a message gives the agent: its text parts, and its data parts as JSON; a file
    part is refused (Cortex agents take text)."""
    pieces: list[str] = []
    for index, part in enumerate(message.parts):
        content = part.WhichOneof("content")
        if content == "text":
            pieces.append(part.text)
        elif content == "data":
            pieces.append(json.dumps(MessageToDict(part.data), ensure_ascii=False))
        else:
            raise ContentTypeNotSupportedError(
                message=f"parts[{index}]: a {content or 'empty'} part; Cortex agents take text "
                        "and data parts")
    text = "\n".join(pieces).strip()
    if not text:
        raise InvalidParamsError(message="message: no text to send (its parts are empty)")
    return text


def context_of(job: JobRecord) -> str:
    """The task's contextId: the job's session (a job started without one is its own)."""
    return job.session or job.id


def agent_message(job_id: str, context_id: str, text: str, suffix: str) -> Message:
    """A message of the agent's, with an id stable across reads (`<job>-<suffix>`)."""
    return Message(message_id=f"{job_id}-{suffix}", context_id=context_id, task_id=job_id,
                   role=Role.ROLE_AGENT, parts=[Part(text=text)])


def response_artifact(text: str) -> Artifact:
    return Artifact(artifact_id=RESPONSE_ARTIFACT, name=RESPONSE_ARTIFACT, parts=[Part(text=text)])


def _stamp(seconds: float | None) -> Timestamp | None:
    if not seconds:
        return None
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _closing_message(job: JobRecord, context_id: str) -> Message | None:
    """What the agent says at its task's end: the result, or why it failed or was cancelled."""
    if job.status == JobStatus.completed:
        return agent_message(job.id, context_id, job.result, "result") if job.result else None
    if job.ended and job.error:
        return agent_message(job.id, context_id, job.error, "error")
    return None


def task_of(job: JobRecord) -> Task:
    """The task a job is now: state, the user's message, and the response once it completed."""
    context_id = context_of(job)
    status = TaskStatus(state=STATES.get(job.status, TaskState.TASK_STATE_UNSPECIFIED))
    stamp = _stamp(job.finished_at or job.started_at or job.created_at)
    if stamp is not None:
        status.timestamp.CopyFrom(stamp)
    closing = _closing_message(job, context_id)
    if closing is not None:
        status.message.CopyFrom(closing)
    task = Task(id=job.id, context_id=context_id, status=status)
    task.history.append(Message(message_id=f"{job.id}-input", context_id=context_id,
                                task_id=job.id, role=Role.ROLE_USER, parts=[Part(text=job.input)]))
    if job.status == JobStatus.completed and job.result:
        task.artifacts.append(response_artifact(job.result))
    task.metadata.update({"cortex": {"job_id": job.id, "agent": job.agent or "",
                                     "status": job.status}})
    return task


def updates_of(job_id: str, context_id: str, event: dict[str, Any]) -> list[Update]:
    """What one event of the job's log means to an A2A client: the job starting, a response
    (the final one as the `response` artifact, others as working-status messages), its end."""
    kind, data = event.get("type"), event.get("data") or {}
    stamp = _stamp(float(event.get("ts") or 0))

    def status(state: TaskState.ValueType, text: str = "", suffix: str = "") -> Update:
        update = TaskStatusUpdateEvent(task_id=job_id, context_id=context_id,
                                       status=TaskStatus(state=state))
        if stamp is not None:
            update.status.timestamp.CopyFrom(stamp)
        if text:
            update.status.message.CopyFrom(agent_message(job_id, context_id, text, suffix))
        return update

    if kind == EventType.job_started:
        return [status(TaskState.TASK_STATE_WORKING)]
    if kind == EventType.response_end and data.get("text"):
        if data.get("final"):
            return [TaskArtifactUpdateEvent(task_id=job_id, context_id=context_id,
                                            artifact=response_artifact(str(data["text"])),
                                            last_chunk=True)]
        return [status(TaskState.TASK_STATE_WORKING, str(data["text"]), f"r{event['seq']}")]
    if kind in END_STATES:
        state = END_STATES[str(kind)]
        if state == TaskState.TASK_STATE_COMPLETED:
            result = data.get("result")
            return [status(state, result if isinstance(result, str) else
                           json.dumps(result) if result is not None else "", "result")]
        why = str(data.get("error") or data.get("reason") or "")
        return [status(state, why, "error")]
    return []
