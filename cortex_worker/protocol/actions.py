"""The action model: one `<action>` block, its attribute and body forms merged (protocol.md §3)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cortex_worker.actions.table import ACTION_TYPES, TARGET_KEYS
from cortex_worker.errors import CortexError

NAME_ALIASES = ("name", *TARGET_KEYS)
"""The body keys that may name an action's target."""

ActionType = StrEnum("ActionType", {name: name for name in ACTION_TYPES})
"""The action types: the rows of `actions.table`."""


class ActionMode(StrEnum):
    sync = "sync"
    async_ = "async"
    fire_and_forget = "fire_and_forget"


class OnError(StrEnum):
    fail = "fail"
    continue_ = "continue"


class Action(BaseModel):
    """A parsed action, ready to be planned and dispatched."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    type: ActionType = ActionType.tool
    mode: ActionMode = ActionMode.sync
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    output_key: str | None = None
    depends_on: tuple[str, ...] = ()
    timeout: float | None = Field(default=None, gt=0)
    retry: int = Field(default=0, ge=0, le=100)
    on_error: OnError = OnError.fail
    in_thought: bool = False
    generated_id: bool = False
    line: int = 1
    column: int = 1

    @field_validator("name", "id")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("output_key")
    @classmethod
    def _strip_key(cls, value: str | None) -> str | None:
        return value.strip() or None if value is not None else None


class ActionError(CortexError, ValueError):
    """An action whose fields are invalid; `kind` is a protocol error kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def parse_depends_on(value: Any) -> list[str]:
    """Accept every `depends_on` form: a list, `"a,b"`, `"a"`, `'["a","b"]'`."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text.strip("[]").replace('"', "").replace("'", "").split(",")
        else:
            value = text.split(",")
    if not isinstance(value, list | tuple):
        raise ActionError("invalid_json", f"depends_on must be a list of action ids, got {value!r}")
    ids: list[str] = []
    for item in value:
        if not isinstance(item, str):
            raise ActionError("invalid_json", f"depends_on entries must be strings, got {item!r}")
        item = item.strip().strip("'\"").strip()
        if item and item not in ids:
            ids.append(item)
    return ids


def build_action(
    attrs: dict[str, str],
    body: dict[str, Any],
    *,
    default_id: str,
    in_thought: bool = False,
    line: int = 1,
    column: int = 1,
) -> tuple[Action, list[str]]:
    """Merge tag attributes and the JSON body into an `Action` plus warnings, or raise `ActionError`."""
    fields: dict[str, Any] = {}
    merged = {**attrs, **{k: v for k, v in body.items() if v is not None}}

    kind = str(merged.get("type", "tool")).strip().lower() or "tool"
    if kind not in ActionType.__members__.values():
        allowed = ", ".join(t.value for t in ActionType)
        raise ActionError("unknown_type", f"unknown action type {kind!r} (expected one of: {allowed})")
    mode = str(merged.get("mode", "sync")).strip().lower() or "sync"
    if mode not in ActionMode.__members__.values():
        allowed = ", ".join(m.value for m in ActionMode)
        raise ActionError("unknown_mode", f"unknown action mode {mode!r} (expected one of: {allowed})")

    names = {k: merged[k] for k in NAME_ALIASES if merged.get(k) not in (None, "")}
    if not names:
        raise ActionError("invalid_json", "action has no 'name' (the tool, agent, relic, workflow or task to run)")
    if len({str(v) for v in names.values()}) > 1:
        raise ActionError("invalid_json", f"action names its target twice, differently: {names}")
    name = next(iter(names.values()))
    if not isinstance(name, str):
        raise ActionError("invalid_json", f"'name' must be a string, got {name!r}")

    parameters = merged.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ActionError("invalid_json", "'parameters' must be a JSON object")

    depends: list[str] = []
    for source in (attrs.get("depends_on"), body.get("depends_on")):
        for dep in parse_depends_on(source):
            if dep not in depends:
                depends.append(dep)

    ident = merged.get("id")
    fields.update(
        id=str(ident) if ident not in (None, "") else default_id,
        generated_id=ident in (None, ""),
        type=kind,
        mode=mode,
        name=name,
        parameters=parameters,
        output_key=merged.get("output_key"),
        depends_on=tuple(depends),
        in_thought=in_thought,
        line=line,
        column=column,
    )
    for key in ("timeout", "retry", "on_error"):
        if merged.get(key) not in (None, ""):
            value = merged[key]
            if isinstance(value, bool):
                raise ActionError("invalid_json", f"{key!r} must be a number, not {value!r}")
            fields[key] = value.strip().lower() if isinstance(value, str) and key == "on_error" else value
    unknown = set(body) - {
        *NAME_ALIASES, "parameters", "output_key", "depends_on", "timeout", "retry",
        "on_error", "id", "type", "mode",
    }
    warnings = [
        f"ignored unknown action field {key!r}; tool arguments belong under 'parameters'"
        for key in sorted(unknown)
    ]
    warnings += [
        f"the body's {key}={body[key]!r} overrides the attribute {key}={attrs[key]!r}"
        for key in sorted(set(attrs) & set(body))
        if key != "depends_on" and body[key] is not None and str(body[key]) != attrs[key]
    ]
    try:
        return Action(**fields), warnings
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ActionError("invalid_json", f"invalid action field {where!r}: {first['msg']}") from None
