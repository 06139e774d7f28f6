"""`type="relic"`: an operation of a long-lived service (`kind: Relic`), named `relic.op`."""

from __future__ import annotations

from collections.abc import Iterable

from cortex_worker.actions.types.base import (
    ActionType,
    Agent,
    Callee,
    Problem,
    Tables,
    Target,
    listing,
    on,
)
from cortex_worker.services.relics.spec import check_relic_action


def check(target: Target) -> list[Problem]:
    return [(kind, f"{target.label}: {message}") for kind, message
            in check_relic_action(target.registry.relics, target.name, target.parameters)]


def grant(agent: Agent, name: str) -> str | None:
    return None if name.split(".", 1)[0] in agent.relics else \
        f"relic {name!r} is not available to agent {agent.name!r}"


def prompt(agent: Agent, registry: Tables) -> str | None:
    return listing('# Relics (type="relic")', agent.relics)


def callees(agent: Agent, registry: Tables) -> Iterable[Callee]:
    for name in agent.relics:
        relic = registry.relics.get(name)
        if relic is None:
            raise LookupError(
                f"agent {agent.name!r} lists relic {name!r}, which is not registered")
        yield from ((f"{name}.{op}", spec.parameters) for op, spec in relic.operations.items())


TYPE = ActionType("relic", check, "cortex_worker.services.relics.action:run_relic_action",
                  on("relic"), grant=grant, prompt=prompt, callees=callees, keyed=True,
                  feed_source=True, workflow_step=True)
