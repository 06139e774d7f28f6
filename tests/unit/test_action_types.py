"""Every action type is one module of `cortex_worker/actions/types/`, and everything that names
the types (the parser, manifests, prompts, grammars) reads them from the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cortex_worker.actions.table import ACTION_TYPES, FEED_SOURCES, TARGET_KEYS, WORKFLOW_STEPS
from cortex_worker.agents.prompt import build_system_prompt
from cortex_worker.agents.spec import AgentSpec, FeedSource
from cortex_worker.llm.grammar import agent_targets
from cortex_worker.manifests.loader import load_registry
from cortex_worker.protocol.actions import NAME_ALIASES, ActionError, ActionType, build_action
from cortex_worker.workflows.spec import WorkflowStep

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TYPES_DIR = REPO / "cortex_worker" / "actions" / "types"
TEST_MANIFESTS = REPO / "tests" / "manifests"


def test_the_table_has_one_row_per_module_of_actions_types() -> None:
    modules = {p.stem for p in TYPES_DIR.glob("*.py")} - {"__init__", "base"}
    assert set(ACTION_TYPES) == modules
    for name, row in ACTION_TYPES.items():
        assert row.runner.startswith("cortex_worker.") and ":" in row.runner, name


def test_the_parser_reads_its_types_and_target_keys_from_the_table() -> None:
    assert [t.value for t in ActionType] == list(ACTION_TYPES)
    assert ("name", *TARGET_KEYS) == NAME_ALIASES
    for name in ACTION_TYPES:
        action, _ = build_action({"type": name}, {"name": "x"}, default_id="a")
        assert action.type.value == name
    with pytest.raises(ActionError) as raised:
        build_action({"type": "nope"}, {"name": "x"}, default_id="a")
    assert raised.value.kind == "unknown_type"
    assert ", ".join(ACTION_TYPES) in str(raised.value)
    for key in TARGET_KEYS:  # `{"tool": "search"}` names the target as `{"name": ...}` does
        action, _ = build_action({"type": key}, {key: "search"}, default_id="a")
        assert action.name == "search"


def test_manifests_allow_the_feed_sources_and_step_types_the_table_declares() -> None:
    def allowed(model: type, field: str) -> list[str]:
        return model.model_json_schema()["properties"][field]["enum"]

    assert allowed(FeedSource, "type") == list(FEED_SOURCES)
    assert [t for t in ACTION_TYPES if ACTION_TYPES[t].feed_source] == list(FEED_SOURCES)
    step_types = WorkflowStep.model_json_schema()["properties"]["type"]
    assert step_types["enum"] == list(WORKFLOW_STEPS)


def test_prompts_and_grammars_list_what_each_type_grants() -> None:
    registry = load_registry(TEST_MANIFESTS)
    for agent in registry.agents.values():
        prompt = build_system_prompt(agent, registry)
        for row in ACTION_TYPES.values():
            section = row.prompt(agent, registry)
            if section is not None:
                assert section in prompt, (agent.name, row.name)
        for target in agent_targets(agent, registry):
            row = ACTION_TYPES[target.type]
            assert row.grant(agent, target.name) is None, (agent.name, target)


def test_an_agent_may_use_only_what_its_manifest_lists() -> None:
    agent = AgentSpec(name="a", tools=["echo"], agents=["b"], relics=["kv"], workflows=["w"])
    allowed = {"tool": "echo", "agent": "b", "relic": "kv.get", "workflow": "w",
               "internal": "set_variable"}
    for type_name, name in allowed.items():
        assert ACTION_TYPES[type_name].grant(agent, name) is None
        refused = ACTION_TYPES[type_name].grant(agent, "other")
        assert refused is not None and "'other'" in refused


_SPECIAL_CASE = re.compile(
    r"""(\.type(\.value)?|\[["']type["']\]|\.get\(["']type["']\))\s*(==|!=|in)\s*\(?["']"""
    rf"""({"|".join(ACTION_TYPES)})["']""")


@pytest.mark.parametrize("room", ["jobs", "actions", "store", "recovery", "worker",
                                  "observability", "llm", "agents", "tools"])
def test_the_engine_asks_the_table_not_the_type_name(room: str) -> None:
    """A per-type difference is a field of the type's row, not an `if type == ...` elsewhere."""
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in sorted((REPO / "cortex_worker" / room).rglob("*.py"))
             if TYPES_DIR not in path.parents
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if _SPECIAL_CASE.search(line)]
    assert not found, "\n".join(found)
