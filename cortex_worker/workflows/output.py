"""The end of a workflow run: its output, rendered from the job's variables, or why it failed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cortex_worker.protocol.variables import Unresolved, find_references, substitute

__all__ = ["failure_message", "output_names", "render_output"]

FAILED = ("error", "timeout")


def output_names(output: Any, default: str) -> set[str]:
    """The variables the output needs: its references, or the default step."""
    return {default} if output is None else find_references(output)


def render_output(output: Any, default: str,
                  values: Mapping[str, Any]) -> tuple[Any, list[Unresolved]]:
    """The workflow's result and the references left as written.

    `output` None: the value of step `default`. A string that is one reference (`"$d"`,
    `"${d.total}"`): that value with its JSON type. A longer string: text. An object or list:
    the same structure with every string substituted in these ways.
    """
    if output is None:
        if default in values:
            return values[default], []
        return None, [Unresolved(f"${default}", "unknown variable")]
    return substitute(output, values)


def failure_message(name: str, actions: Mapping[str, Mapping[str, Any]]) -> str:
    """Why a run failed, from `Store.actions()`: the steps that failed and those skipped."""
    failed: list[str] = []
    skipped: list[str] = []
    order = sorted(actions.items(), key=lambda kv: int((kv[1].get("spec") or {}).get("line") or 0))
    for action_id, entry in order:
        status = entry.get("status")
        record = entry.get("result") or {}
        spec = entry.get("spec") or {}
        if status in FAILED:
            what = f"{spec.get('type', 'tool')} {spec.get('name', '?')}"
            verb = "timed out" if status == "timeout" else "failed"
            failed.append(f"step {action_id!r} ({what}) {verb}: {record.get('error') or status}")
        elif status in ("skipped", "cancelled"):
            skipped.append(action_id)
    text = f"workflow {name!r}: " + ("; ".join(failed) or "a step failed")
    if skipped:
        text += f"; not run: {', '.join(skipped)}"
    return text
