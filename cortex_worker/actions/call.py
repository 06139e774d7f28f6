"""What a runner is given (`Call`) and how it says a child job will end its action (`Deferred`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cortex_worker.settings import Settings


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
    #                   the action's idempotency key (`job_id:action_id`)
