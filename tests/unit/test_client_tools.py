"""Client tools (`JobOptions.client_tools`) in what the model reads: the system prompt, the
native function definitions and the protocol grammar list them with the agent's own tools."""

from __future__ import annotations

from pathlib import Path

import pytest
from lark import Lark
from lark.exceptions import LarkError
from pydantic import ValidationError

from cortex_worker.agents.prompt import build_system_prompt, tool_functions, tool_names
from cortex_worker.jobs.options import ClientTool, JobOptions
from cortex_worker.llm import grammar as gr
from cortex_worker.llm.config import ModelConfig
from cortex_worker.manifests.loader import Registry, load_registry

pytestmark = pytest.mark.unit

TEST_MANIFESTS = Path(__file__).resolve().parents[2] / "tests" / "manifests"
PICK = ClientTool(name="pick_color", description="Ask the user\nto pick a colour.",
                  parameters={"type": "object", "properties": {"hint": {"type": "string"}},
                              "required": ["hint"]})


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(TEST_MANIFESTS)


def test_the_prompt_lists_client_tools_with_the_agents_tools(registry: Registry) -> None:
    agent = registry.agent("tester")
    plain = build_system_prompt(agent, registry)
    prompt = build_system_prompt(agent, registry, [PICK])
    assert "pick_color" not in plain
    listed = prompt.split('# Tools (type="tool")')[1]
    assert listed.index("- deploy") < listed.index(
        '- pick_color: Ask the user to pick a colour.\n  parameters: {"type":"object"')
    assert prompt.count('# Tools (type="tool")') == 1


def test_an_agent_without_tools_is_told_of_its_client_tools(registry: Registry) -> None:
    bare = registry.agent("tester").model_copy(update={"tools": []})
    assert "None: do not write" in build_system_prompt(bare, registry)
    prompt = build_system_prompt(bare, registry, [PICK])
    assert "None: do not write" not in prompt and "- pick_color" in prompt


def test_native_tools_offer_client_tools_as_functions(registry: Registry) -> None:
    agent = registry.agent("native")
    functions = tool_functions(agent, registry, [PICK])
    assert functions[-1] == {"type": "function", "function": {
        "name": "pick_color", "parameters": PICK.parameters,
        "description": "Ask the user\nto pick a colour."}}
    assert [f["function"]["name"] for f in functions[:-1]] == agent.tools
    assert tool_names(agent, [PICK])["pick_color"] == "pick_color"
    native = build_system_prompt(agent, registry, [PICK])
    assert "- pick_color" in native and '{"type":"object","properties":{"hint"' not in native


def test_the_grammar_admits_calls_of_client_tools(registry: Registry) -> None:
    agent = registry.agent("tester").model_copy(
        update={"model": ModelConfig(grammar="lark", base_url="http://127.0.0.1:1/v1")})
    names = [t.name for t in gr.agent_targets(agent, registry, [PICK]) if t.type == "tool"]
    assert names == [*agent.tools, "pick_color"]
    call = '<action type="tool" mode="sync">{"name": "pick_color", "parameters": ' \
           '{"hint": "warm"}}</action>'

    def parser(client: list[ClientTool]) -> Lark:
        text = gr.build_grammar(agent, registry, "lark", client_tools=client)
        assert isinstance(text, str)
        return Lark(text, start="start", parser="earley", lexer="dynamic")

    parser([PICK]).parse(call)
    with pytest.raises(LarkError):
        parser([]).parse(call)


def test_a_client_tool_is_named_as_a_function_may_be() -> None:
    with pytest.raises(ValidationError):
        ClientTool(name="pick color")
    assert JobOptions(client_tools=[PICK, ClientTool(name="x")]).client_tool_names() == [
        "pick_color", "x"]
    assert ClientTool(name="x").parameters == {"type": "object", "properties": {}}
