"""What a runner is given (`Call`) and how it says a child job will end its action (`Deferred`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # kept light: tool code in the sandbox imports `idempotency_key` from here
    from cortex_worker.settings import Settings


def idempotency_key(job_id: str, action_id: str) -> str:
    """The key every attempt of one action shares, so that a tool run again (at-least-once
    delivery) can recognise a side effect it already made (docs/manifests.md, Idempotency)."""
    return f"{job_id}:{action_id}"


@dataclass(frozen=True, slots=True)
class ChildJob:
    """A child job an action asks for: the executor starts it (`jobs.submit_child`), and its
    end records the action's outcome."""

    kind: Literal["agent", "workflow"]
    name: str
    input: Any


class Deferred(Exception):
    """The action goes on in a child job (`child`); its outcome is recorded when that ends."""

    def __init__(self, child: ChildJob) -> None:
        super().__init__(f"{child.kind} {child.name!r}")
        self.child = child


@dataclass(frozen=True, slots=True)
class Call:
    """One run of an action: where it belongs, what it is, and its substituted parameters."""

    job_id: str
    action_id: str
    spec: Mapping[str, Any]
    params: Any
    timeout: float
    settings: Settings
    attempt: int = 1  # this run's attempt (claim's fencing number); every attempt shares
    #                   the action's `idempotency_key` (tools get both: `tools.attempt`)
