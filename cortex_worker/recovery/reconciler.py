"""Recovery driven from Cortex's own state: find work a dead process lost and send it again.

One pass (`reconcile`) runs every `reconcile_every_s` in whichever worker process takes the
lock first (any may: no single point of failure). It walks the jobs that have not ended and
re-drives, with a `warning` event each time:

- a start that was queued but never began (documents, workflows: `cortex.start_job`; agents:
  their first turn);
- a turn whose coordinator died (no heartbeat): at the first pass that sees it, then with
  the grace period doubling while the job makes no progress;
- a job left `finishing` (its last action ended but the worker died before acting on it);
- an action `queued` and unclaimed past the grace period whose message the broker no longer
  holds (it was lost: kombu pops a message before it records it as unacked; one still queued
  behind other work only waits), sent again with the grace doubling each time;
- an action `running` whose worker died: its lease is released and it is sent again, at most
  `max_redrives` times; then it fails with the reason, and its job goes on as with any failure.

Re-sending is harmless: `claim` runs an action once and `finish` records it once; `begin` and
`resume` start a job or a turn once. A canvas step sent again runs by readiness dispatch, and so
does the rest of its branch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cortex_worker.actions import dispatch, executor
from cortex_worker.jobs import approvals
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.jobs.kinds import KINDS
from cortex_worker.jobs.record import JobRecord
from cortex_worker.recovery import fencing
from cortex_worker.recovery.liveness import Heartbeat, dead
from cortex_worker.recovery.owners import CHILD_OWNER, owner
from cortex_worker.settings import Settings
from cortex_worker.store.keys import RECONCILER_LOCK
from cortex_worker.store.state import ActionState, Store

log = logging.getLogger(__name__)

#: Fields of the job record a pass reads.
FIELDS = ("kind", "status", "created_at", "progress_at", "closed", "turn", "turn_owner",
          "turn_lease")
BACKOFF_CAP_S = 300.0
#: How many jobs a pass reads at once.
BATCH = 500


class Reconciler:
    """The recovery rules, applied to every active job by `reconcile`."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store, self.settings = store, settings
        self.grace = settings.redrive_grace_s
        self._held: set[str] | None = None  # the broker's messages, read once a pass

    def _in_broker(self, task_id: str) -> bool:
        """Whether the broker still holds the message of `task_id` (queued behind others, or
        taken within a grace period by a worker that has not acknowledged it): then it is not
        lost, only waiting.
        Read once a pass, when the first queued message is due (`Broker.held`; a broker that
        cannot tell holds nothing, and the message is sent again)."""
        if self._held is None:  # a worker that took one more than a grace ago may be dead
            self._held = dispatch.current_broker().held(time.time() - self.grace) or set()
        return task_id in self._held

    def reconcile(self) -> int:
        """One pass over the active jobs; returns how many things were sent again."""
        self._held = None  # read again this pass, if needed
        ids = self.store.active_jobs()
        return sum(self._batch(ids[at:at + BATCH]) for at in range(0, len(ids), BATCH))

    def _batch(self, ids: list[str]) -> int:
        """The rules for these jobs, on what a few round trips read for all of them (a pass
        over 100 streaming agents cost an agent worker more CPU than a reader of them)."""
        now = time.time()
        live: list[JobRecord] = []
        for job_id, job in zip(ids, self.store.peek_many(ids, *FIELDS), strict=True):
            if job is None or job.ended:
                self.store.forget_active(job_id)
            else:
                live.append(job)
        states = self.store.action_states([job.id for job in live])
        owners = {job.turn_owner for job in live
                  if job.kind == "agent" and not job.closed and job.turn_owner}
        holders = {s.owner for actions in states for s in actions.values()
                   if s.status == "running" and s.owner}
        gone = dead(self.store, owners | holders)
        return sum(self._job(job, actions, gone, now)
                   for job, actions in zip(live, states, strict=True))

    def _due(self, since: float | None, times: int, now: float) -> bool:
        """Untouched for the grace period, doubled for each time it was sent again."""
        return since is not None and now - since > min(self.grace * 2 ** times, BACKOFF_CAP_S)

    def _due_job(self, job_id: str, what: str, since: float | None, now: float, *,
                 at_once: bool = False) -> bool:
        """`_due` for a job's start, drain or turn; counts the time it is sent again.
        `at_once`: the first time needs no grace period (its holder is known to be dead)."""
        if not at_once and not self._due(since, 0, now):  # no need to read the count
            return False
        times = self.store.redrives(job_id, what)
        if not (at_once and times == 0) and not self._due(since, times, now):
            return False
        self.store.count_redrive(job_id, what)
        return True

    def _job(self, job: JobRecord, states: dict[str, ActionState], gone: set[str],
             now: float) -> int:
        last = job.progress_at or job.created_at
        if job.status == "queued" or (job.status == "running" and job.kind != "agent" and not job.closed):
            if self._due(last, 0, now) and self._in_broker(f"{job.id}:start"):
                return 0  # its start waits in its lane behind others' work
            if self._due_job(job.id, "@start", last, now):
                self._warn(job.id, "start_redriven", f"the {job.kind} job had not started "
                           f"{now - job.created_at:.0f} s after it was queued; its start was sent again")
                KINDS[job.kind].send_start(job.id)
                return 1
            return 0
        if job.status == "finishing":
            if self._due_job(job.id, "@drained", last, now):
                self._warn(job.id, "drain_redriven", "nothing was left to wait for, but nobody "
                           "acted on it (a worker stopped, or the agent pool is busy); the job goes on")
                jobs.on_drained(self.store, job.id)
                return 1
            return 0
        sent = 0
        if job.kind == "agent" and not job.closed and job.turn_owner and job.turn_owner in gone \
                and self._due_job(job.id, f"@turn{job.turn}", last, now, at_once=True):
            self._warn(job.id, "turn_redriven", f"turn {job.turn}: its coordinator "
                       f"{job.turn_owner} stopped; the turn was sent again")
            dispatch.agent_turn(job.id)  # `resume` hands it over: the owner has no heartbeat
            sent += 1
        return sent + self._actions(job.id, states, gone, now)

    def _actions(self, job_id: str, states: dict[str, ActionState], gone: set[str],
                 now: float) -> int:
        if any(s.status == approvals.AWAITING for s in states.values()):
            self._expire_approvals(job_id, now)
        specs: list[dict[str, Any]] = []
        for action_id, state in states.items():
            spec = self._redrive(job_id, action_id, state, gone, now)
            if spec is not None:
                specs.append(spec)
        dispatch.send(job_id, specs)
        return len(specs)

    def _expire_approvals(self, job_id: str, now: float) -> None:
        """Reject the approval requests nobody answered in time."""
        for action_id, request in self.store.approvals(job_id).items():
            if request["state"] == "requested" and now >= request["expires_at"]:
                jobs.decide_approval(self.store, job_id, action_id, approve=False, by="timeout",
                                     reason=f"no answer within {request['timeout_s']:g} s")

    def _redrive(self, job_id: str, action_id: str, state: ActionState, gone: set[str],
                 now: float) -> dict[str, Any] | None:
        if state.status == "queued" and state.owner is None:
            if not self._due(state.queued_at, state.redrives, now) \
                    or self._waits_for_slot(job_id, action_id, state) \
                    or self._waits_for_model(state, now) \
                    or self._in_broker(dispatch.task_id(job_id, action_id)):
                return None
            outcome, value = self.store.redrive(
                job_id, action_id, "", f"action {action_id!r} was queued "
                f"{now - (state.queued_at or now):.0f} s ago and no worker took it (its message "
                "was lost); it was sent again", most=1_000_000)
            return value if outcome == "send" else None
        if state.status != "running" or state.owner is None:
            return None
        if state.owner.startswith(CHILD_OWNER):
            return None  # a child job runs it; the child is recovered on its own
        expired = state.lease_until is not None and now - state.lease_until > self.grace
        if state.owner not in gone and not expired:
            return None
        why = (f"its worker {state.owner} stopped" if state.owner in gone
               else f"its lease (held by {state.owner}) ran out")
        outcome, value = self.store.redrive(job_id, action_id, state.owner,
                                            f"action {action_id!r}: {why}; it was sent again",
                                            most=self.settings.max_redrives)
        if outcome == "give_up":
            spec = self.store.spec(job_id, action_id) or {"id": action_id}
            executor.record_outcome(self.store, job_id, action_id, spec, "error", None,
                                    f"lost {value} time(s): {why} each time "
                                    f"(max_redrives is {self.settings.max_redrives})")
            return None
        return value if outcome == "send" else None

    def _waits_for_model(self, state: ActionState, now: float) -> bool:
        """A queued action held off its pool while its model endpoint is paused
        (`executor.model_wait`) comes back when the pause ends: lost only a grace period
        after that."""
        return state.model_wait_until is not None and now <= state.model_wait_until + self.grace

    def _waits_for_slot(self, job_id: str, action_id: str, state: ActionState) -> bool:
        """A queued action that waits for a slot (its tool's `max_concurrency`, its tenant's
        `max_actions_in_flight`) waits its turn while one of its caps is full (a freed slot
        sends it); with a slot free in each, its wake-up was lost."""
        if state.throttled_at is None:
            return False
        spec = self.store.spec(job_id, action_id)
        if spec is None:
            return False
        return any(self.store.slots_in_use(gate) >= limit
                   for gate, limit in executor.gates(job_id, spec))

    def _warn(self, job_id: str, kind: str, message: str) -> None:
        log.warning("job %s: %s", job_id, message)
        self.store.emit(job_id, [("warning", {"kind": kind, "message": message})], live=True)


def heartbeat(store: Store, settings: Settings) -> Heartbeat:
    """This process's heartbeat (not started: the `heartbeat` step of `cortex_worker.worker.steps`
    starts one in each worker process), which also runs a reconciler pass whenever it takes the
    lock (once per `reconcile_every_s` across all processes)."""
    reconciler = Reconciler(store, settings)

    def tick() -> None:
        if store.try_lock(RECONCILER_LOCK, owner(), settings.reconcile_every_s):
            reconciler.reconcile()

    return Heartbeat(store, settings.heartbeat_s, settings.liveness_ttl_s, tick,
                     watch=lambda: fencing.check(store))
