"""`kind: Model` manifests: named model endpoints, `model: NAME` references from agents,
workflows and CORTEX_DOCUMENT_MODEL (resolved when the manifests are linked), inline blocks
with `limits`, and what `cortex validate` and `POST /v1/validate` make of them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cortex_api.app import create_app
from cortex_api.cli import app as cli
from cortex_worker import handles
from cortex_worker.jobs import lifecycle
from cortex_worker.llm.config import ModelConfig, ModelLimits, ModelSpec
from cortex_worker.manifests.loader import ManifestError, UnknownModelError, load_registry
from cortex_worker.protocol.document import load_document
from cortex_worker.settings import Settings
from tests.manifest_helpers import TEST_MANIFESTS, load_error, write

pytestmark = pytest.mark.unit

FAST = """\
kind: Model
name: fast-gpt
description: gpt-4o-mini on the team's account.
base_url: ${LLM_URL}
model: gpt-4o-mini
api_key_env: null
max_tokens: 2048
limits: {requests_per_minute: 300, tokens_per_minute: 200000, max_concurrent: 8}
"""

LLM_DOCUMENT = '<action type="llm" id="s">{"name": "summarize", "parameters": {"prompt": "x"}}' \
               '</action>'


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """File names in messages are relative to `tmp_path`; no CORTEX_DOCUMENT_MODEL; the
    process's handles are read anew by the tests that point them somewhere."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CORTEX_DOCUMENT_MODEL", raising=False)
    monkeypatch.delenv("LLM_URL", raising=False)
    handles.reset()
    yield
    handles.reset()


# ---------------------------------------------------------------- loading Models


def test_a_model_loads_with_its_name_description_and_limits(tmp_path: Path) -> None:
    write(tmp_path, "m/models.yaml", FAST)
    registry = load_registry(tmp_path / "m")
    spec = registry.models["fast-gpt"]
    assert isinstance(spec, ModelSpec) and spec.description == "gpt-4o-mini on the team's account."
    assert registry.source("Model", "fast-gpt") == "m/models.yaml"
    config = spec.config()
    assert type(config) is ModelConfig  # what the engine sees: no kind, no description
    assert config.name == "fast-gpt" and config.endpoint() == "fast-gpt"
    assert config.base_url == "${LLM_URL}"  # read from the environment only when used
    assert config.model == "gpt-4o-mini" and config.api_key_env is None
    assert config.max_tokens == 2048
    assert config.limits == ModelLimits(requests_per_minute=300, tokens_per_minute=200000,
                                        max_concurrent=8)


def test_models_in_a_section_take_the_provider_defaults(tmp_path: Path) -> None:
    write(tmp_path, "m/models.yaml", """\
        models:
          - name: claude
            provider: anthropic
          - name: local
            base_url: http://127.0.0.1:8080/v1
            model: qwen2.5
            api_key_env: null
            grammar: gbnf
        """)
    registry = load_registry(tmp_path / "m")
    claude = registry.model("claude")
    assert claude.base_url == "https://api.anthropic.com/v1"
    assert claude.api_key_env == "ANTHROPIC_API_KEY" and claude.limits is None
    assert registry.model("local").grammar == "gbnf"
    assert sorted(registry.models) == ["claude", "local"]


def test_broken_models_are_reported_together_naming_file_and_field(tmp_path: Path) -> None:
    write(tmp_path, "m/models.yaml", """\
        models:
          - name: inline-mine
          - name: 4o
          - name: ok
            limits: {rpm: 5}
          - name: hot
            provider: anthropic
            temperature: 1.5
          - name: slow
            limits: {max_concurrent: 0}
        """)
    message = load_error(tmp_path / "m")
    assert message.startswith("5 problems:")
    assert ("m/models.yaml: models[0] 'inline-mine': name: 'inline-mine': names starting with "
            "'inline-' are kept for the endpoints of inline model blocks") in message
    assert "m/models.yaml: models[1] '4o': name: '4o' is not a valid model name" in message
    assert ("m/models.yaml: models[2] 'ok': limits.rpm: Extra inputs are not permitted"
            in message)
    assert ("m/models.yaml: models[3] 'hot': temperature: provider anthropic accepts a "
            "temperature from 0 to 1") in message
    assert ("m/models.yaml: models[4] 'slow': limits.max_concurrent: Input should be greater "
            "than 0") in message


def test_a_model_name_is_unique(tmp_path: Path) -> None:
    write(tmp_path, "m/a.yaml", FAST)
    write(tmp_path, "m/b.yaml", FAST)
    assert load_error(tmp_path / "m") == (
        "m/b.yaml: Model 'fast-gpt': model 'fast-gpt' is already defined in m/a.yaml")


# ---------------------------------------------------------------- references by name


def test_agents_and_workflows_refer_to_a_model_by_name(tmp_path: Path) -> None:
    write(tmp_path, "m/agents.yaml", """\
        agents:
          - name: writer
            model: fast-gpt
          - name: editor
            model: fast-gpt
            tools: [echo]
        workflows:
          - name: digest
            model: fast-gpt
            steps: [{id: s, type: llm, name: summarize, parameters: {prompt: hi}}]
        """)
    write(tmp_path, "m/z_models.yaml", FAST)  # loaded after the agents: links see it anyway
    registry = load_registry(tmp_path / "m")
    expected = registry.models["fast-gpt"].config()
    for name in ("writer", "editor"):
        model = registry.agent(name).model
        assert model == expected and model.name == "fast-gpt"
        assert model.endpoint() == "fast-gpt"
    assert registry.workflow("digest").model == expected
    # the job option `model` makes another endpoint, with the Model's limits
    other = expected.named("gpt-4o")
    assert other.name is None and other.limits == expected.limits
    assert other.endpoint().startswith("inline-")


def test_an_unknown_model_names_the_agent_the_file_and_the_known_models(tmp_path: Path) -> None:
    write(tmp_path, "m/models.yaml", FAST + "---\nkind: Model\nname: claude\nprovider: anthropic\n")
    write(tmp_path, "m/agents.yaml", """\
        agents:
          - name: writer
            model: gpt-4o
          - name: fine
            model: claude
        workflows:
          - name: digest
            model: fats-gpt
            steps: [{id: s, type: llm, name: summarize, parameters: {prompt: hi}}]
        """)
    with pytest.raises(ManifestError) as info:
        load_registry(tmp_path / "m")
    assert info.value.problems == [
        "m/agents.yaml: agents[0] 'writer': model: unknown model 'gpt-4o'; declare it with "
        "kind: Model (known models: claude, fast-gpt), or give the provider's model name in a "
        "block: `model: {model: gpt-4o}`",
        "m/agents.yaml: workflows[0] 'digest': model: unknown model 'fats-gpt'; declare it "
        "with kind: Model (known models: claude, fast-gpt), or give the provider's model name "
        "in a block: `model: {model: fats-gpt}`",
    ]


def test_an_unknown_model_without_any_model_says_none(tmp_path: Path) -> None:
    write(tmp_path, "m/agent.yaml", "kind: Agent\nname: a\nmodel: fast\n")
    assert load_error(tmp_path / "m") == (
        "m/agent.yaml: Agent 'a': model: unknown model 'fast'; declare it with kind: Model "
        "(known models: none), or give the provider's model name in a block: "
        "`model: {model: fast}`")


def test_a_tool_choice_names_one_of_the_agents_tools(tmp_path: Path) -> None:
    """`tool_choice` may name a tool (the model must call it); one the agent does not list is
    refused at load, naming the agent's tools. A shared `kind: Model` is checked per agent."""
    write(tmp_path, "m/models.yaml", "kind: Model\nname: forcing\nmodel: m\n"
                                     "tool_choice: calculator\n")
    write(tmp_path, "m/agents.yaml", """\
        agents:
          - name: fine
            model: forcing
            tools: [echo, calculator]
          - name: wrong
            model: forcing
            tools: [echo]
        """)
    assert load_error(tmp_path / "m") == (
        "m/agents.yaml: agents[1] 'wrong': model.tool_choice: 'calculator' is not one of the "
        "agent's tools (its tools: echo); or use auto, required or none")
    write(tmp_path, "m/agents.yaml", "kind: Agent\nname: fine\nmodel: forcing\n"
                                     "tools: [echo, calculator]\n")
    assert load_registry(tmp_path / "m").agents["fine"].model.forced_tool == "calculator"


def test_a_model_value_is_a_block_or_a_name(tmp_path: Path) -> None:
    write(tmp_path, "m/agents.yaml", """\
        agents:
          - name: a
            model: {name: fast-gpt}
          - name: b
            model: 3
          - name: c
            model: ""
          - name: d
            model: {temprature: 1}
        """)
    write(tmp_path, "m/models.yaml", FAST)
    with pytest.raises(ManifestError) as info:
        load_registry(tmp_path / "m")
    assert info.value.problems == [
        "m/agents.yaml: agents[0] 'a': model: an inline model block has no `name`; to use a "
        "kind: Model, write `model: fast-gpt` instead of a block",
        "m/agents.yaml: agents[1] 'b': model: give a model block (a mapping) or the name of a "
        "kind: Model, got int",
        "m/agents.yaml: agents[2] 'c': model: give a model block or the name of a kind: "
        "Model, not an empty string",
        "m/agents.yaml: agents[3] 'd': model.temprature: Extra inputs are not permitted",
    ]


def test_inline_blocks_keep_working_and_may_carry_limits(tmp_path: Path) -> None:
    block = "{base_url: 'http://x/v1', model: qwen, api_key_env: null, limits: {max_concurrent: 2}}"
    write(tmp_path, "m/agents.yaml", f"""\
        agents:
          - name: a
            model: {block}
          - name: b
            model: {block}
          - name: plain
            model: {{model: gpt-4o}}
        """)
    registry = load_registry(tmp_path / "m")
    a, b = registry.agent("a").model, registry.agent("b").model
    assert a.name is None and a.limits == ModelLimits(max_concurrent=2)
    assert re.fullmatch(r"inline-[0-9a-f]{12}", a.endpoint())
    assert a.endpoint() == b.endpoint()  # the same block: one endpoint, one set of limits
    plain = registry.agent("plain").model
    assert plain.limits is None and plain.endpoint() != a.endpoint()
    assert registry.model(plain) is plain


def test_registry_model_lists_the_known_models(tmp_path: Path) -> None:
    write(tmp_path, "m/models.yaml", FAST)
    registry = load_registry(tmp_path / "m")
    with pytest.raises(UnknownModelError, match=r"unknown model 'nope'.*known models: fast-gpt"):
        registry.model("nope")


# ---------------------------------------------------------------- CORTEX_DOCUMENT_MODEL


def test_the_document_model_may_name_a_model(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "m/models.yaml", FAST)
    monkeypatch.setenv("CORTEX_MANIFESTS", str(tmp_path / "m"))
    monkeypatch.setenv("CORTEX_DOCUMENT_MODEL", "fast-gpt")
    settings = Settings()
    assert settings.document_model == "fast-gpt"
    handles.reset()
    assert lifecycle.check_document(load_document(LLM_DOCUMENT)) == []
    field = lifecycle.model_of_document(settings, lifecycle.JobOptions())["model"]
    assert ModelConfig.model_validate(field) == handles.get_registry().model("fast-gpt")
    assert field["name"] == "fast-gpt" and field["limits"]["max_concurrent"] == 8
    # the job option `model`: the same endpoint's settings, another model, no name
    field = lifecycle.model_of_document(settings, lifecycle.JobOptions(model="gpt-4o"))["model"]
    assert field["model"] == "gpt-4o" and "name" not in field  # the default, left out
    assert field["limits"]["max_concurrent"] == 8


def test_the_document_model_as_json_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_DOCUMENT_MODEL", json.dumps(
        {"base_url": "http://x/v1", "model": "docs", "api_key_env": None,
         "limits": {"requests_per_minute": 60}}))
    model = Settings().document_model
    assert isinstance(model, ModelConfig) and model.model == "docs"
    assert model.limits == ModelLimits(requests_per_minute=60)
    monkeypatch.setenv("CORTEX_DOCUMENT_MODEL", '{"model": ')
    with pytest.raises(ValueError, match="a model block must be a JSON object"):
        Settings()


def test_an_unknown_document_model_name_stops_the_registry(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "m/models.yaml", FAST)
    monkeypatch.setenv("CORTEX_MANIFESTS", str(tmp_path / "m"))
    monkeypatch.setenv("CORTEX_DOCUMENT_MODEL", "slow-gpt")
    handles.reset()
    with pytest.raises(ManifestError) as info:
        handles.get_registry()
    assert str(info.value) == (
        "CORTEX_DOCUMENT_MODEL (document_model): unknown model 'slow-gpt'; declare it with "
        "kind: Model (known models: fast-gpt), or give the provider's model name in a block: "
        "`model: {model: slow-gpt}`")


# ---------------------------------------------------------------- cortex validate, POST /v1/validate


def _broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Manifests whose agent names a Model no manifest declares, as CORTEX_MANIFESTS."""
    write(tmp_path, "m/agents.yaml", "agents:\n  - {name: writer, model: fast-gpt}\n")
    monkeypatch.setenv("CORTEX_MANIFESTS", str(tmp_path / "m"))
    handles.reset()
    return write(tmp_path, "doc.xml", '<action id="a">{"name": "echo", "parameters": '
                                      '{"message": "hi"}}</action>')


def test_cortex_validate_reports_an_unknown_model(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _broken(tmp_path, monkeypatch)
    result = CliRunner().invoke(cli, ["validate", str(doc)])
    assert result.exit_code == 2
    assert result.stderr.startswith("invalid manifests: m/agents.yaml: agents[0] 'writer': "
                                    "model: unknown model 'fast-gpt'")
    write(tmp_path, "m/models.yaml", FAST)  # declared: the document is valid
    handles.reset()
    result = CliRunner().invoke(cli, ["validate", str(doc)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "valid"


def test_post_validate_reports_an_unknown_model(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _broken(tmp_path, monkeypatch)
    client = TestClient(create_app(Settings()))  # no lifespan: validating needs no Redis
    response = client.post("/v1/validate", json={"protocol": doc.read_text()})
    assert response.status_code == 500
    assert response.json()["detail"]["message"].startswith(
        "m/agents.yaml: agents[0] 'writer': model: unknown model 'fast-gpt'")


# ---------------------------------------------------------------- the shipped manifests


def test_the_test_manifests_declare_a_model_no_agent_depends_on() -> None:
    registry = load_registry(TEST_MANIFESTS)
    limited = registry.model("limited")
    assert limited.base_url == "${CORTEX_TEST_LLM_URL}" and limited.limits is not None
    assert all(agent.model.name is None for agent in registry.agents.values())
