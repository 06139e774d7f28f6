"""`kind: Agent` manifests: loading, cross-reference errors, and the registry routes."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cortex_api.app import create_app
from cortex_api.routes.registry import registry_dep
from cortex_worker.agents.prompt import build_system_prompt
from cortex_worker.manifests.loader import ManifestError, Registry, UnknownAgentError, load_registry
from cortex_worker.settings import Settings
from cortex_worker.tools.spec import BUILTIN_TOOLS
from tests.manifest_helpers import (
    EXAMPLE_MANIFESTS,
    TEST_AGENTS,
    TEST_MANIFESTS,
    load_error,
    write,
)

pytestmark = pytest.mark.unit



@pytest.fixture(autouse=True)
def _chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File names in messages are relative to the current directory."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------- the shipped manifests


def test_test_manifests_load_without_expanding_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORTEX_TEST_LLM_URL", raising=False)
    registry = load_registry(TEST_MANIFESTS)
    assert sorted(registry.agents) == TEST_AGENTS
    tester = registry.agent("tester")
    assert tester.model.base_url == "${CORTEX_TEST_LLM_URL}"
    assert tester.model.model == "tester" and tester.model.api_key_env is None
    assert tester.tools == ["echo", "sleep", "calculator", "fail", "flaky", "web_scraper", "python",
                            "deploy"]
    assert tester.agents == ["helper"] and tester.max_turns == 4
    assert registry.agent("helper").max_turns == 3
    assert registry.agent("native").model.native_tools is True
    blocked = registry.agent("blocked").internal_actions
    assert not blocked.permits("clear_context") and blocked.permits("set_variable")
    assert registry.source("Agent", "tester").endswith("tests/manifests/agents.yaml")


def test_example_manifests_load() -> None:
    registry = load_registry(EXAMPLE_MANIFESTS)
    researcher = registry.agent("researcher")
    assert researcher.model.provider == "replay"
    assert researcher.model.transcript == "examples/transcripts/research.yaml"
    assert {"echo", "calculator", "python", "read_file", "write_file", "grep", "sleep"} <= set(
        researcher.tools
    )
    assistant = registry.agent("assistant")
    assert assistant.model.base_url == "https://api.openai.com/v1"
    assert assistant.model.api_key_env == "OPENAI_API_KEY"


def test_agent_lookup_lists_known_agents() -> None:
    registry = load_registry(TEST_MANIFESTS)
    with pytest.raises(UnknownAgentError, match=r"unknown agent 'nope'; known agents: analyzer, blocked, "):
        registry.agent("nope")
    with pytest.raises(UnknownAgentError, match="known agents: none"):
        Registry().agent("x")


# ---------------------------------------------------------------- loading and linking


def test_order_independent_references_and_single_kind_documents(tmp_path: Path) -> None:
    # a.yaml names an agent and a tool declared later, in z.yaml
    write(tmp_path, "m/a.yaml", """\
        kind: Agent
        name: boss
        tools: [shout, echo]
        agents: [worker]
        """)
    write(tmp_path, "m/z.yaml", """\
        agents:
          - name: worker
        tools:
          - name: shout
            runtime: shell
            command: ["echo", "hi"]
        """)
    registry = load_registry(tmp_path / "m")
    assert registry.agent("boss").agents == ["worker"]
    assert registry.source("Agent", "worker") == "m/z.yaml"


def test_system_prompt_file_is_read_relative_to_the_manifest(tmp_path: Path) -> None:
    write(tmp_path, "m/sub/prompts/boss.md", "Be terse.\n")
    write(tmp_path, "m/sub/agents.yaml", """\
        agents:
          - name: boss
            system_prompt_file: prompts/boss.md
        """)
    agent = load_registry(tmp_path / "m").agent("boss")
    assert agent.system_prompt == "Be terse.\n"
    assert agent.system_prompt_file == "prompts/boss.md"


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        (
            "agents:\n  - name: a\n    tools: [echo, nope]\n",
            "m/agents.yaml: agents[0] 'a': tools[1]: unknown tool 'nope'; declare it with "
            "kind: Tool or remove it (known tools: ",
        ),
        (
            "agents:\n  - name: a\n    agents: [ghost]\n",
            "m/agents.yaml: agents[0] 'a': agents[0]: unknown agent 'ghost'; declare it with "
            "kind: Agent or remove it (known agents: a)",
        ),
        (
            "kind: Agent\nname: a\nagents: [a]\n",
            "m/agents.yaml: Agent 'a': agents[0]: an agent cannot list itself",
        ),
        (
            "agents:\n  - name: a\n    system_prompt_file: missing.md\n",
            "m/agents.yaml: agents[0] 'a': system_prompt_file: cannot read 'missing.md' "
            "(m/missing.md, relative to the manifest): No such file or directory",
        ),
        (
            "agents:\n  - name: a\n    system_prompt: hi\n    system_prompt_file: p.md\n",
            "m/agents.yaml: agents[0] 'a': system_prompt_file: give the instructions either "
            "inline",
        ),
        (
            "agents:\n  - name: a\n    internal_actions: {blocked: [clear_context, reboot]}\n",
            "m/agents.yaml: agents[0] 'a': internal_actions.blocked[1]: unknown internal action "
            "'reboot' (expected one of: add_context_feed, ",
        ),
        (
            "agents:\n  - name: a\n    internal_actions: {allowed: [set_var]}\n",
            "m/agents.yaml: agents[0] 'a': internal_actions.allowed[0]: unknown internal action "
            "'set_var'",
        ),
        (
            "agents:\n  - name: a\n    max_turns: 0\n",
            "m/agents.yaml: agents[0] 'a': max_turns: Input should be greater than 0",
        ),
        (
            "agents:\n  - name: a\n    max_turns: many\n",
            "m/agents.yaml: agents[0] 'a': max_turns: Input should be a valid integer",
        ),
        (
            "agents:\n  - name: a\n    tools: [echo, echo]\n",
            "m/agents.yaml: agents[0] 'a': tools[1]: 'echo' is listed twice",
        ),
        (
            "agents:\n  - name: a\n    model: {provider: gemini}\n",
            "m/agents.yaml: agents[0] 'a': model.provider: Input should be 'openai', 'anthropic' "
            "or 'replay'",
        ),
        (
            "agents:\n  - name: a\n    model: {api_key: sk-123}\n",
            "m/agents.yaml: agents[0] 'a': model.api_key: Extra inputs are not permitted",
        ),
        (
            "agents:\n  - name: a\n    context_feeds:\n"
            "      - {id: f, type: periodic, source: {type: internal, name: clock}}\n",
            "m/agents.yaml: agents[0] 'a': context_feeds[0].interval: required when type is "
            "'periodic'",
        ),
        (
            "agents:\n  - name: a\n    context_feeds:\n"
            "      - {id: f, source: {type: tool, name: nope}}\n",
            "m/agents.yaml: agents[0] 'a': context_feeds[0].source.name: unknown tool 'nope'",
        ),
        (
            "agents:\n  - name: a\n  - name: a\n",
            "m/agents.yaml: agents[1] 'a': agent 'a' is already defined in m/agents.yaml",
        ),
    ],
)
def test_errors_name_file_and_field(tmp_path: Path, manifest: str, expected: str) -> None:
    write(tmp_path, "m/agents.yaml", manifest)
    assert load_error(tmp_path / "m").startswith(expected)


def test_relics_and_workflows_must_exist(tmp_path: Path) -> None:
    write(tmp_path, "m/agents.yaml", "agents:\n  - {name: a, relics: [kv], workflows: [etl]}\n")
    with pytest.raises(ManifestError, match=r"workflows\[0\]: unknown workflow 'etl'"):
        load_registry(tmp_path / "m")
    write(tmp_path, "n/agents.yaml", "agents:\n  - {name: a, relics: [kv, sql]}\n")
    assert load_registry(tmp_path / "n").agent("a").relics == ["kv", "sql"]


# ---------------------------------------------------------------- the registry routes


@pytest.fixture
def client() -> TestClient:
    """The real app, without its lifespan (so no Redis), on the test manifests."""
    app = create_app(Settings(manifests=TEST_MANIFESTS))
    registry = load_registry(TEST_MANIFESTS)
    app.dependency_overrides[registry_dep] = lambda: registry
    return TestClient(app)


def test_list_agents(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_TEST_LLM_URL", "http://secret.example")
    response = client.get("/v1/agents")
    assert response.status_code == 200
    items = response.json()["items"]
    assert [item["name"] for item in items] == TEST_AGENTS
    tester = items[-1]
    assert tester["model"]["base_url"] == "${CORTEX_TEST_LLM_URL}"
    assert tester["model"]["provider"] == "openai" and tester["model"]["model"] == "tester"
    assert tester["agents"] == ["helper"] and tester["max_turns"] == 4
    assert "secret" not in response.text and "api_key" not in response.text


def test_get_agent(client: TestClient) -> None:
    body = client.get("/v1/agents/blocked").json()
    assert body["name"] == "blocked"
    assert "clear_context" not in body["internal_actions"]
    assert "set_variable" in body["internal_actions"]
    assert body["max_depth"] == 3
    registry = load_registry(TEST_MANIFESTS)
    prompt = build_system_prompt(registry.agent("blocked"), registry)
    assert body["system_prompt"] == prompt and body["system_prompt_chars"] == len(prompt)
    listed = {item["name"]: item for item in client.get("/v1/agents").json()["items"]}
    assert listed["blocked"]["system_prompt_chars"] == len(prompt)


def test_unknown_agent_is_404(client: TestClient) -> None:
    response = client.get("/v1/agents/ghost")
    assert response.status_code == 404
    detail = response.json()["detail"]
    assert detail["message"] == "agent 'ghost' not found"
    assert "tester" in detail["known"]


def test_tools_routes(client: TestClient) -> None:
    items = client.get("/v1/tools").json()["items"]
    names = [item["name"] for item in items]
    assert names == sorted(names) and set(BUILTIN_TOOLS) <= set(names) and "web_scraper" in names
    calculator = client.get("/v1/tools/calculator").json()
    assert calculator["runtime"] == "builtin"
    assert calculator["parameters"]["required"] == ["expression"]
    word_count = client.get("/v1/tools/word_count").json()
    assert word_count["runtime"] == "shell" and word_count["timeout"] == 10
    response = client.get("/v1/tools/ghost")
    assert response.status_code == 404
    assert response.json()["detail"]["message"] == "tool 'ghost' not found"
