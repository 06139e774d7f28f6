"""What a runner is given (`Call`) and how it says a child job will end its action (`Deferred`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cortex_worker.settings import Settings


class Deferred(Exception):
    """The action goes on elsewhere (a child job); its outcome is recorded when that ends."""


@dataclass(frozen=True, slots=True)
class Call:
    """One run of an action: where it belongs, what it is, and its substituted parameters."""

    job_id: str
    action_id: str
    spec: Mapping[str, Any]
    params: Any
    timeout: float
    settings: Settings
