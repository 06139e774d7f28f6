"""The manifest loader (cortex_worker.manifests.loader): registries, and errors naming file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex_worker.manifests.loader import BUILTIN_SOURCE, ManifestError, Registry, load_registry
from cortex_worker.protocol.document import load_document
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import BUILTIN_TOOLS, validate_parameters
from tests.manifest_helpers import (
    CORPUS,
    EXAMPLE_MANIFESTS,
    TEST_MANIFESTS,
    load_error,
    write,
)

pytestmark = pytest.mark.unit


TEST_TOOLS = {
    "web_scraper", "arxiv_search", "news_api", "api_call", "data_collector", "quick_analyzer",
    "log_aggregator", "metrics_collector", "debug_tracer", "fail", "flaky", "count_calls",
    "word_count", "box_echo", "box_wc", "box_sleep", "box_sh", "box_net", "box_net_host",
    "box_missing", "rate_limited", "deploy",
    "distance", "shout",  # @tool functions of function_tools.py (kind: ToolModule)
    "time.get_current_time", "time.convert_time",  # mcp.yaml: mcp-server-time
    "faulty.crash", "faulty.pid", "faulty.hang", "faulty.fail",  # mcp.yaml: tests/mcp_servers
}  # fmt: skip


@pytest.fixture(autouse=True)
def _chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File names in messages are relative to the current directory."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------- loading


def test_builtins_only() -> None:
    for registry in (load_registry(None), load_registry(Path("does/not/exist"))):
        assert set(registry.tools) == set(BUILTIN_TOOLS)
        assert registry.source("Tool", "echo") == BUILTIN_SOURCE
        assert registry.module_paths == [] and registry.directory is None


def test_test_manifests_load() -> None:
    registry = load_registry(TEST_MANIFESTS)
    assert set(registry.tools) == TEST_TOOLS | set(BUILTIN_TOOLS)
    assert registry.module_paths == [TEST_MANIFESTS.resolve()]
    assert registry.tools["word_count"].command == ["wc", "-w", "{path}"]
    assert registry.source("Tool", "web_scraper").endswith("tests/manifests/tools.yaml")


def test_example_manifests_load() -> None:
    registry = load_registry(EXAMPLE_MANIFESTS)
    assert {"word_count", "slugify", "top_words"} <= set(registry.tools)


def test_corpus_tool_calls_match_the_test_tools() -> None:
    """Every type="tool" action of the protocol corpus names a known tool with valid parameters."""
    registry = load_registry(TEST_MANIFESTS)
    seen = set()
    for path in sorted(CORPUS.glob("*.xml")):
        for action in load_document(path.read_text()).actions:
            if action.type.value != "tool":
                continue
            seen.add(action.name)
            validate_parameters(registry.tool(action.name), dict(action.parameters))
    assert {"web_scraper", "arxiv_search", "calculator", "metrics_collector"} <= seen


def test_kinds_sections_and_file_layout(tmp_path: Path) -> None:
    root = tmp_path / "m"
    write(
        root,
        "one.yaml",
        """
        kind: Tool
        name: upper
        runtime: python
        entrypoint: texttools:upper
        ---
        # an empty document is fine
        ---
        tools:
          - name: lower
            runtime: python
            entrypoint: texttools.sub:lower
          - kind: Tool
            name: count
            runtime: shell
            command: [wc, -c, "{path}"]
            parameters:
              type: object
              properties: {path: {type: string}}
              required: [path]
        """,
    )
    write(root, "nested/two.yml", "kind: Tool\nname: boxed\nruntime: docker\nimage: alpine:3\n")
    write(root, ".hidden/three.yaml", "kind: Nonsense\n")
    write(root, "notes.txt", "kind: Nonsense\n")
    registry = load_registry(root)
    assert {"upper", "lower", "count", "boxed"} <= set(registry.tools)
    assert registry.source("Tool", "boxed") == "m/nested/two.yml"
    assert registry.tools["upper"].parameters == {"type": "object"}
    assert registry.tools["upper"].limits.memory_mb == 512


def test_registry_tool_lookup() -> None:
    registry = Registry()
    with pytest.raises(ToolError, match="unknown tool 'x'; known tools: none"):
        registry.tool("x")


# ---------------------------------------------------------------- errors


def test_every_problem_of_a_broken_directory_is_reported(tmp_path: Path) -> None:
    """Not only the first: each broken object of each file, and what the links find, each
    naming its file and field; the objects that load well are not reported."""
    write(tmp_path, "a_tools.yaml", """
        tools:
          - {name: good, runtime: shell, command: ["true"]}
          - {name: grep2, runtime: perl, command: [grep]}
          - just a string
          - {name: nocmd, runtime: shell}
        """)
    write(tmp_path, "b_broken.yaml", "tools: [\n")
    write(tmp_path, "c_agents.yaml", """
        kind: Agent
        name: helper
        system_prompt: hi
        model: {base_url: "http://127.0.0.1:9", api_key_env: null}
        tools: [good, grep2, ghost]
        """)
    write(tmp_path, "d_kind.yaml", "kind: Tol\nname: x\n")
    with pytest.raises(ManifestError) as info:
        load_registry(tmp_path)
    problems = info.value.problems
    assert [p.split(": ", 2)[:2] for p in problems] == [
        ["a_tools.yaml", "tools[1] 'grep2'"],
        ["a_tools.yaml", "tools[2]"],
        ["a_tools.yaml", "tools[3] 'nocmd'"],
        ["b_broken.yaml", "invalid YAML"],
        ["d_kind.yaml", "kind"],
        ["c_agents.yaml", "Agent 'helper'"],  # a link: after every file has loaded
    ]
    assert problems[0].startswith("a_tools.yaml: tools[1] 'grep2': runtime: Input should be ")
    assert problems[2] == "a_tools.yaml: tools[3] 'nocmd': runtime 'shell' needs command"
    assert problems[5].startswith("c_agents.yaml: Agent 'helper': tools[1]: unknown tool 'grep2'")
    assert str(info.value) == "6 problems:\n" + "\n".join(f"  {p}" for p in problems)


def test_one_problem_is_reported_alone(tmp_path: Path) -> None:
    write(tmp_path, "tools.yaml", "tools:\n  - {name: grep2, runtime: perl, command: [grep]}\n")
    with pytest.raises(ManifestError) as info:
        load_registry(tmp_path)
    assert info.value.problems == [str(info.value)]
    assert str(info.value).startswith("tools.yaml: tools[0] 'grep2': runtime: ")


def test_error_names_file_section_index_name_and_field(tmp_path: Path) -> None:
    write(
        tmp_path,
        "tools.yaml",
        """
        tools:
          - {name: a, runtime: python, entrypoint: "m:a"}
          - {name: b, runtime: python, entrypoint: "m:b"}
          - {name: grep2, runtime: perl, command: [grep]}
        """,
    )
    assert load_error(tmp_path) == (
        "tools.yaml: tools[2] 'grep2': runtime: Input should be 'python', 'shell', 'docker' "
        "or 'builtin'"
    )


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ("kind: Agnet\nname: x\n", "x.yaml: kind: unknown kind 'Agnet' (expected one of: Tool, ToolModule, Agent, "),
        ("name: x\nruntime: python\n", "x.yaml: missing 'kind'"),
        ("- 1\n- 2\n", "x.yaml: a manifest must be a mapping with 'kind', got list"),
        ("tools: {name: x}\n", "x.yaml: tools: must be a list of tools"),
        ("tools: [3]\n", "x.yaml: tools[0]: must be a mapping, got int"),
        ("tools:\n  - {kind: Relic, name: x}\n", "x.yaml: tools[0] 'x': kind: 'Relic' in 'tools'"),
        (
            "kind: Tool\nname: x\nruntime: python\nentrypoint: m:f\ncolour: red\n",
            "x.yaml: Tool 'x': colour: Extra inputs are not permitted",
        ),
        (
            "kind: Tool\nname: x\nruntime: python\nentrypoint: m:f\nlimits: {memory_mb: -1}\n",
            "x.yaml: Tool 'x': limits.memory_mb: Input should be greater than 0",
        ),
        (
            "kind: Tool\nname: x\nruntime: python\n",
            "x.yaml: Tool 'x': runtime 'python' needs entrypoint",
        ),
        (
            "kind: Tool\nname: x\nruntime: python\nentrypoint: not-a-path\n",
            "x.yaml: Tool 'x': entrypoint: must look like 'module:function' (e.g. 'mytools:search' or "
            "'pkg.mod:run'), got 'not-a-path'",
        ),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: [ls]\nentrypoint: m:f\n",
            "runtime 'shell' does not use entrypoint; remove it",
        ),
        ("kind: Tool\nname: x\nruntime: docker\ncommand: [ls]\n", "runtime 'docker' needs image"),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: []\n",
            "x.yaml: Tool 'x': command: List should have at least 1 item",
        ),
        (
            "kind: Tool\nname: x\nruntime: builtin\n",
            "x.yaml: Tool 'x': runtime: 'builtin' is reserved for the tools built into the worker",
        ),
        (
            "kind: Tool\nname: 'bad name'\nruntime: shell\ncommand: [ls]\n",
            "x.yaml: Tool 'bad name': name: 'bad name' is not a valid tool name",
        ),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: [ls]\nenv: {'BAD-NAME': v}\n",
            "x.yaml: Tool 'x': env: invalid environment variable name(s): 'BAD-NAME'",
        ),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: [ls]\nparameters: {type: object, properties: {a: {type: strin}}}\n",
            "x.yaml: Tool 'x': parameters: not a valid JSON Schema: ",
        ),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: [ls]\nparameters: {type: array}\n",
            "x.yaml: Tool 'x': parameters: the root must be of type 'object'",
        ),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: [ls]\nreturns: {type: 12}\n",
            "x.yaml: Tool 'x': returns: not a valid JSON Schema",
        ),
        (
            "kind: Tool\nname: x\nruntime: shell\ncommand: [ls]\ntimeout: 0\n",
            "x.yaml: Tool 'x': timeout: Input should be greater than 0",
        ),
        ("kind: Tool\nname: x\nruntime: shell\ncommand: [cat, '{path'\n", "x.yaml: invalid YAML: "),
        (
            "kind: Tool\n---\nkind: Tool\nname: x\nruntime: shell\n",
            "x.yaml: document 1: Tool: name: Field required",
        ),
    ],
)
def test_manifest_errors(manifest: str, message: str, tmp_path: Path) -> None:
    write(tmp_path, "x.yaml", manifest)
    error = load_error(tmp_path)
    assert error.startswith(message) or message in error, error


@pytest.mark.parametrize(
    ("command", "parameters", "message"),
    [
        (
            '[wc, "{path}"]',
            "{type: object}",
            "command[1] uses {path} but 'parameters' declares no property 'path'",
        ),
        (
            '[wc, "{path}"]',
            "{type: object, properties: {path: {type: string}}}",
            "command[1] uses {path}: list 'path' in parameters.required or give it a default",
        ),
        ('[awk, "{print $1}"]', "{type: object}", "command[1]: bad placeholder '{print $1}'"),
        ('[echo, "a}"]', "{type: object}", "command[1]: bad placeholder '}'"),
    ],
)
def test_placeholders_are_validated_at_load(
    command: str, parameters: str, message: str, tmp_path: Path
) -> None:
    write(
        tmp_path,
        "x.yaml",
        f"kind: Tool\nname: t\nruntime: shell\ncommand: {command}\nparameters: {parameters}\n",
    )
    assert message in load_error(tmp_path)


def test_placeholders_accepted(tmp_path: Path) -> None:
    write(
        tmp_path,
        "x.yaml",
        """
        kind: Tool
        name: t
        runtime: shell
        command: [awk, "{{print $1}}", "{path}", "--mode={mode}"]
        parameters:
          type: object
          properties: {path: {type: string}, mode: {type: string, default: fast}}
          required: [path]
        """,
    )
    assert load_registry(tmp_path).tools["t"].command is not None


def test_conflict_with_a_builtin(tmp_path: Path) -> None:
    write(tmp_path, "x.yaml", "kind: Tool\nname: echo\nruntime: shell\ncommand: [echo]\n")
    assert "tool 'echo' in x.yaml conflicts with the built-in tool" in load_error(tmp_path)
    write(tmp_path, "x.yaml", "kind: Tool\nname: x\nruntime: shell\ncommand: [wc, -l, 3]\n")
    assert load_error(tmp_path) == "x.yaml: Tool 'x': command[2]: Input should be a valid string"


def test_duplicate_names_across_files(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "kind: Tool\nname: dup\nruntime: shell\ncommand: ['true']\n")
    write(tmp_path, "b/c.yaml", "tools: [{name: dup, runtime: shell, command: ['false']}]\n")
    assert (
        load_error(tmp_path) == "b/c.yaml: tools[0] 'dup': tool 'dup' is already defined in a.yaml"
    )


def test_path_that_is_not_a_directory(tmp_path: Path) -> None:
    path = write(tmp_path, "single.yaml", "kind: Tool\n")
    assert load_error(path) == "single.yaml: not a directory; give the manifests directory"


def test_absolute_names_outside_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "m"
    write(root, "x.yaml", "kind: Bogus\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_error(root).startswith(f"{root}/x.yaml: kind: unknown kind 'Bogus'")
