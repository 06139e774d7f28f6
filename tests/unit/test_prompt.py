"""What the model reads (cortex_worker.agents.prompt): system prompt and turn feedback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cortex_worker.agents.prompt import (
    EXAMPLE,
    PROTOCOL_REMINDER,
    PROTOCOL_RULES,
    build_system_prompt,
    format_errors,
    format_feeds,
    format_results,
    tool_functions,
)
from cortex_worker.agents.spec import AgentSpec, InternalActionPolicy
from cortex_worker.manifests.loader import Registry, load_registry
from cortex_worker.protocol.document import load_document

pytestmark = pytest.mark.unit

TEST_MANIFESTS = Path(__file__).resolve().parents[2] / "tests" / "manifests"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(TEST_MANIFESTS)


def compact(schema: dict) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- the system prompt


def test_prompt_has_protocol_example_and_every_tool_schema(registry: Registry) -> None:
    agent = registry.agent("tester")
    prompt = build_system_prompt(agent, registry)
    assert "# You\n\nYou are tester, an agent running in Cortex." in prompt
    for word in ("<thought>", "depends_on", "fire_and_forget", "async", "sync", "$$",
                 'final="false"', 'final="true"', "<result id=", "<context_feed id=",
                 '"name"', '"parameters"'):
        assert word in prompt, word
    assert EXAMPLE in prompt
    for name in agent.tools:
        spec = registry.tool(name)
        assert f"- {name}: " in prompt
        assert compact(spec.parameters) in prompt
    assert "- helper: A nested agent" in prompt
    assert '"parameters": {"input": ' in prompt
    # sections come in a fixed order
    order = ["# How you work", "## Example", "# You\n", '# Tools (type="tool")',
             '# Agents (type="agent")', '# Internal actions (type="internal")']
    positions = [prompt.index(heading) for heading in order]
    assert positions == sorted(positions)


def test_every_prompt_starts_with_the_same_protocol_prefix(registry: Registry) -> None:
    """Providers cache a prompt's prefix: the protocol and the example come first, the same
    for every agent, before anything of the agent's own."""
    prompts = [build_system_prompt(agent, registry) for agent in registry.agents.values()]
    prefix = f"{PROTOCOL_RULES}\n\n{EXAMPLE}\n\n# You\n\nYou are "
    assert len(prompts) > 3 and all(prompt.startswith(prefix) for prompt in prompts)


def test_a_native_tools_prompt_does_not_repeat_the_function_schemas(registry: Registry) -> None:
    native = build_system_prompt(registry.agent("native"), registry)
    textual = build_system_prompt(
        registry.agent("native").model_copy(update={"model": registry.agent("tester").model}),
        registry)
    assert compact(registry.tool("calculator").parameters) in textual
    assert compact(registry.tool("calculator").parameters) not in native
    assert len(native) < len(textual)


def test_prompt_is_deterministic(registry: Registry) -> None:
    agent = registry.agent("tester")
    first = build_system_prompt(agent, registry)
    again = build_system_prompt(load_registry(TEST_MANIFESTS).agent("tester"),
                                load_registry(TEST_MANIFESTS))
    assert first == again


def test_example_is_a_valid_protocol_document() -> None:
    body = EXAMPLE.split("(tool names here are only an illustration)", 1)[1]
    doc = load_document(body.replace("Next turn, with `<result id=\"total\" status=\"ok\">"
                                     "5020000</result>` in your context:", ""))
    report = doc.to_json()
    assert report["errors"] == []
    assert [a["id"] for a in report["actions"]] == ["paris", "rome", "total"]
    assert [a["mode"] for a in report["actions"]] == ["async", "async", "sync"]
    assert report["actions"][2]["depends_on"] == ["paris", "rome"]
    assert report["responses"][0]["final"] is True


def test_instructions_relics_workflows_feeds_and_policy(registry: Registry) -> None:
    agent = AgentSpec.model_validate({
        "name": "a",
        "description": "Does things.",
        "system_prompt": "  Always be brief.  \n",
        "tools": ["echo"],
        "relics": ["kv"],
        "workflows": ["etl"],
        "context_feeds": [{"id": "now", "source": {"type": "internal", "name": "clock"}},
                          {"id": "off", "enabled": False,
                           "source": {"type": "internal", "name": "clock"}}],
        "internal_actions": {"allowed": ["set_variable", "clear_context"],
                             "blocked": ["clear_context"]},
        "model": {"native_tools": True},
    })
    prompt = build_system_prompt(agent, registry)
    assert "You are a, an agent running in Cortex. Does things.\n\n# Your instructions" in prompt
    assert "# Your instructions\n\nAlways be brief.\n\n# Tools" in prompt
    assert "native function calls" in prompt
    assert "- echo: " in prompt and "parameters: {" not in prompt  # in the function definitions
    assert '# Relics (type="relic")\n\n- kv' in prompt
    assert '# Workflows (type="workflow")\n\n- etl' in prompt
    assert "- now (on_demand)" in prompt and "- off" not in prompt
    internal = prompt.split('# Internal actions (type="internal")', 1)[1]
    assert "set_variable" in internal
    assert "clear_context" not in internal and "add_context_feed" not in internal
    assert "Agents (type" not in prompt


def test_nothing_to_use(registry: Registry) -> None:
    agent = AgentSpec(name="bare", internal_actions=InternalActionPolicy(enabled=False))
    prompt = build_system_prompt(agent, registry)
    assert 'None: do not write type="tool" actions.' in prompt
    assert 'None: do not write type="internal" actions.' in prompt
    assert "# Your instructions" not in prompt


def test_blocked_agent_prompt_omits_clear_context(registry: Registry) -> None:
    prompt = build_system_prompt(registry.agent("blocked"), registry)
    internal = prompt.split('# Internal actions (type="internal")', 1)[1]
    assert "clear_context" not in internal and "set_variable" in internal


def test_tool_functions(registry: Registry) -> None:
    functions = tool_functions(registry.agent("native"), registry)
    assert [f["function"]["name"] for f in functions] == ["echo", "calculator"]
    calculator = functions[1]
    assert calculator["type"] == "function"
    assert calculator["function"]["parameters"] == registry.tool("calculator").parameters
    assert calculator["function"]["description"].startswith("Evaluate")
    json.dumps(functions)  # serialisable as is


# ---------------------------------------------------------------- turn feedback


def test_format_results() -> None:
    text = format_results([
        {"id": "a", "status": "ok", "value": {"x": 1, "s": "é"}},
        {"id": "b", "status": "ok", "value": "plain text"},
        {"id": "c", "status": "error", "error": "boom"},
        {"id": "d", "status": "skipped", "error": {"message": "dependency 'c' failed"}},
        {"id": "e", "status": "ok", "value": None},
    ])
    assert text.splitlines() == [
        '<result id="a" status="ok">{"x": 1, "s": "é"}</result>',
        '<result id="b" status="ok">plain text</result>',
        '<result id="c" status="error">boom</result>',
        '<result id="d" status="skipped">{"message": "dependency \'c\' failed"}</result>',
        '<result id="e" status="ok">null</result>',
    ]
    assert format_results([]) == ""


def test_format_results_truncates_long_outputs() -> None:
    text = format_results([{"id": "big", "status": "ok", "value": "x" * 150}], limit_chars=100)
    assert text == (
        '<result id="big" status="ok">' + "x" * 100
        + "\n[truncated: 50 more characters; pass $big to an action to use the whole value]"
        "</result>"
    )
    generated = format_results([{"id": "echo-3", "status": "error", "error": "e" * 20}],
                               limit_chars=5)
    assert "[truncated: 15 more characters; the rest is not shown]" in generated
    assert format_results([{"id": "ok", "status": "ok", "value": "y" * 10}], limit_chars=10) == (
        '<result id="ok" status="ok">yyyyyyyyyy</result>'
    )


def test_format_results_escapes_and_rejects_unknown_status() -> None:
    text = format_results([{"id": 'q"x', "status": "ok", "value": "a </result> b"}])
    assert text == "<result id='q\"x' status=\"ok\">a <\\/result> b</result>"
    with pytest.raises(ValueError, match="unknown status 'done'"):
        format_results([{"id": "a", "status": "done", "value": 1}])


def test_format_feeds() -> None:
    text = format_feeds({"b": {"cpu": 0.5}, "a": "2024-06-15T14:32:18Z"})
    assert text == (
        '<context_feed id="a">2024-06-15T14:32:18Z</context_feed>\n'
        '<context_feed id="b">{"cpu": 0.5}</context_feed>'
    )
    cut = format_feeds({"log": "z" * 30}, max_chars=10)
    assert cut == '<context_feed id="log">' + "z" * 10 + "\n[truncated: 20 more characters]</context_feed>"
    assert format_feeds({}) == ""


def test_format_feeds_parses_back() -> None:
    doc = load_document(format_feeds({"now": "noon", "stats": {"n": 3}}))
    assert doc.feeds == {"now": "noon", "stats": {"n": 3}}


def test_format_errors() -> None:
    text = format_errors([
        {"kind": "invalid_json", "message": "action body: invalid JSON: Expecting value",
         "line": 3, "column": 14, "action_id": "a"},
        {"kind": "unknown_mode", "message": "unknown action mode 'parallel'", "line": 5,
         "column": 1},
        {"kind": "something_new", "message": "odd"},
    ])
    lines = text.splitlines()
    assert lines[0] == "<feedback>" and lines[-1] == "</feedback>"
    assert "3 protocol errors" in lines[1]
    assert lines[2].startswith("- line 3, column 14: invalid_json (action 'a'): action body: "
                               "invalid JSON: Expecting value. Fix: write the body as one valid "
                               "JSON object")
    assert lines[3].startswith("- line 5, column 1: unknown_mode: unknown action mode "
                               "'parallel'. Fix: mode must be one of: sync, async, "
                               "fire_and_forget")
    assert lines[4] == ("- something_new: odd. Fix: rewrite the block following the protocol "
                        "rules.")
    assert format_errors([]) == ""


def test_format_errors_of_a_parsed_document() -> None:
    doc = load_document('<action id="a">{"name": "echo", parameters: {}}</action>')
    text = format_errors(doc.to_json()["errors"])
    assert "1 protocol error." in text and "invalid_json" in text and "line 1" in text


def test_protocol_reminder() -> None:
    assert '<response final="true">' in PROTOCOL_REMINDER
    assert "<action" in PROTOCOL_REMINDER
    assert len(PROTOCOL_REMINDER) < 400
