"""Unit tests for `cortex validate` and the help of every command (cortex_api.cli).

`validate` checks targets only against manifests: each test runs without any (a directory
that does not exist) unless it points CORTEX_MANIFESTS at some itself."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from cortex_api.cli import app
from cortex_worker import handles
from cortex_worker.jobs.lifecycle import check_document
from cortex_worker.protocol.document import load_document
from tests.manifest_helpers import CORPUS, EXAMPLE_MANIFESTS

pytestmark = pytest.mark.unit

CORPUS_NAMES = [
    "mk1_01_complete_example.xml",
    "mk1_02_actions_in_thoughts.xml",
    "mk1_03_non_terminating_responses.xml",
    "mk1_04_context_feeds_runtime.xml",
    "mk1_05_internal_actions.xml",
    "mk1_06_combined_v1_1.xml",
    "mk1_07_parser_demo_stream.xml",
    "mk1_08_depends_on_attribute_variant.xml",
    "mk1_09_features_doc_variant.xml",
]
JSON_KEYS = ["actions", "thoughts", "responses", "text", "errors", "warnings", "waves"]
ACTION_KEYS = ["id", "type", "mode", "name", "parameters", "output_key", "depends_on", "after",
               "in_thought"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")

N_SHAPED = """\
<action id="A" mode="async">{"name": "a"}</action>
<action id="B" mode="async">{"name": "b"}</action>
<action id="C" mode="async" depends_on="A">{"name": "c"}</action>
<action id="D" mode="async" depends_on="A,B">{"name": "d"}</action>
"""

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_manifests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """CORTEX_MANIFESTS names a directory that does not exist; the handles read it anew."""
    missing = tmp_path / "no-manifests"
    monkeypatch.setenv("CORTEX_MANIFESTS", str(missing))
    handles.reset()
    yield missing
    handles.reset()


@pytest.fixture
def example_manifests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifests that ship in examples/, as a new user has them."""
    monkeypatch.setenv("CORTEX_MANIFESTS", str(EXAMPLE_MANIFESTS))
    handles.reset()


def corpus(name: str) -> Path:
    path = CORPUS / name
    assert path.is_file(), f"corpus document {path} is missing"
    return path


def invoke(*args: str | Path) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `cortex validate ARGS`."""
    result = runner.invoke(app, ["validate", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, ANSI.sub("", result.stdout), ANSI.sub("", result.stderr)


def validate(*args: str | Path) -> tuple[int, str]:
    code, out, _ = invoke(*args)
    return code, out


def validate_json(path: Path, *args: str) -> tuple[int, str, dict[str, Any]]:
    code, out = validate("--json", *args, path)
    return code, out, json.loads(out)


def write(tmp_path: Path, text: str, name: str = "doc.xml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_corpus_is_present() -> None:
    assert CORPUS.is_dir(), f"protocol corpus not found at {CORPUS}"
    assert sorted(p.name for p in CORPUS.glob("*.xml")) == CORPUS_NAMES


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_validate_json_on_corpus(name: str) -> None:
    code, out, report = validate_json(corpus(name))
    assert code == 0
    assert list(report) == JSON_KEYS
    assert report["errors"] == []
    assert report["actions"]
    for item in report["actions"]:
        assert list(item) == ACTION_KEYS
    for problem in report["warnings"]:
        assert list(problem) == ["kind", "message", "line", "column"]
    # every action is scheduled exactly once
    assert sorted(i for wave in report["waves"] for i in wave) == sorted(
        a["id"] for a in report["actions"])
    assert out.endswith("}\n")


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_validate_json_is_byte_identical_for_any_chunk_size(name: str) -> None:
    path = corpus(name)
    _, reference, _ = validate_json(path)
    for size in (1, 2, 3, 7, 64, 100000):
        code, out = validate("--json", "--chunk", str(size), path)
        assert code == 0
        assert out == reference, size


def test_n_shaped_dag_waves(tmp_path: Path) -> None:
    code, _, report = validate_json(write(tmp_path, N_SHAPED))
    assert code == 0
    assert report["waves"] == [["A", "B"], ["C", "D"]]
    assert [(a["id"], a["depends_on"], a["after"]) for a in report["actions"]] == [
        ("A", [], []), ("B", [], []), ("C", ["A"], []), ("D", ["A", "B"], [])]


def test_human_summary(tmp_path: Path) -> None:
    doc = N_SHAPED + '<thought>t<action id="E">{"name": "e"}</action></thought>\n'
    code, out = validate(write(tmp_path, doc))
    assert code == 0
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0] == "5 actions"
    rows = [[cell.strip() for cell in line.strip("│").split("│")]
            for line in out.splitlines() if line.startswith("│")]
    assert rows == [
        ["A", "tool", "async", "a", "-", ""],
        ["B", "tool", "async", "b", "-", ""],
        ["C", "tool", "async", "c", "A", ""],
        ["D", "tool", "async", "d", "A, B", ""],
        ["E", "tool", "sync", "e", "-", "yes"],
    ]
    assert "wave 1: A, B, E" in lines
    assert "wave 2: C, D" in lines
    assert "critical path: A → C (2 s estimated)" in lines
    assert "responses: 0 (0 final), thoughts: 1, feeds: 0" in lines
    assert lines[-1] == "valid"


def test_human_summary_header_and_sync_barrier(tmp_path: Path) -> None:
    doc = ('<action id="s">{"name": "x"}</action>'
           '<action id="t" mode="async">{"name": "y"}</action>')
    code, out = validate(write(tmp_path, doc))
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")] == [
        "id", "type", "mode", "name", "waits for", "in thought"]
    assert "│ t  │ tool │ async │ y    │ s (sync)  │" in out
    assert "wave 1: s\nwave 2: t\n" in out
    assert "critical path: s → t (2 s estimated)" in out


def test_critical_path_with_estimates(tmp_path: Path) -> None:
    path = write(tmp_path, N_SHAPED)
    code, out = validate("--estimate", "B=3", "--estimate", "D=2.5", path)
    assert code == 0
    assert "critical path: B → D (5.5 s estimated)" in out


def test_invalid_estimate_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = invoke("--estimate", "B", write(tmp_path, N_SHAPED))
    assert code == 2
    assert "write ID=SECONDS" in err


def test_corpus_summary_mentions_waves_and_warnings() -> None:
    code, out = validate(corpus("mk1_04_context_feeds_runtime.xml"))
    assert code == 0
    assert "wave 1: lightweight_analysis" in out
    assert "critical path: lightweight_analysis (1 s estimated)" in out
    assert "responses: 0 (0 final), thoughts: 1, feeds: 2" in out
    assert "warning 20:1 unknown_reference: $input_data" in out
    assert out.rstrip().endswith("valid")


@pytest.mark.parametrize(("doc", "error"), [
    ('x\n<action id="a">{"name": t}</action>\n',
     {"kind": "invalid_json", "message": "action body: invalid JSON: Expecting value",
      "line": 2, "column": 25}),
    ('<action id="a" mode="async" depends_on="b">{"name": "t"}</action>\n'
     '<action id="b" mode="async">{"name": "t", "parameters": {"x": "$a"}}</action>\n',
     {"kind": "cycle", "message": "dependency cycle: a -> b -> a", "line": 1, "column": 1}),
    ('hi\n  <action id="a" depends_on="ghost">{"name": "t"}</action>\n',
     {"kind": "unknown_dependency",
      "message": "action 'a' depends on 'ghost', which is not an action in this document",
      "line": 2, "column": 3}),
    ('<action id="a">{"name": "t"}</action><action id="a">{"name": "u"}</action>',
     {"kind": "duplicate_id",
      "message": "action id 'a' is already used in this job; give each action its own id",
      "line": 1, "column": 38}),
    ("<thought>never closed",
     {"kind": "unclosed_block", "message": "<thought> block is never closed with </thought>",
      "line": 1, "column": 1}),
])
def test_document_with_an_error_exits_1_and_still_prints_json(tmp_path: Path, doc: str,
                                                              error: dict[str, Any]) -> None:
    path = write(tmp_path, doc)
    code, out, report = validate_json(path)
    assert code == 1
    assert list(report) == JSON_KEYS
    assert report["errors"] == [error]
    for size in (1, 3):
        assert validate("--json", "--chunk", str(size), path) == (1, out)


def test_human_summary_of_a_document_with_an_error(tmp_path: Path) -> None:
    code, out = validate(write(tmp_path, 'x\n<action id="a">{"name": t}</action>\n'))
    assert code == 1
    lines = out.splitlines()
    assert lines[-3:-1] == ["responses: 0 (0 final), thoughts: 0, feeds: 0",
                            "error 2:25 invalid_json: action body: invalid JSON: Expecting value"]
    assert lines[-1].startswith("target names not checked: no manifests at ")
    assert "valid" not in lines


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    code, _ = validate(tmp_path / "nope.xml")
    assert code == 2


def test_chunk_must_be_positive(tmp_path: Path) -> None:
    code, _ = validate("--chunk", "0", write(tmp_path, N_SHAPED))
    assert code == 2


UNKNOWN_TOOL = ('<action id="a" mode="async">{"name": "no_such_tool"}</action>\n'
                '<action id="b" mode="async">{"name": "echo", "parameters": {"message": 1}}'
                '</action>\n')


def test_without_manifests_it_says_target_names_were_not_checked(tmp_path: Path,
                                                                  no_manifests: Path) -> None:
    path = write(tmp_path, UNKNOWN_TOOL)
    code, out = validate(path)
    assert code == 0
    assert out.splitlines()[-2:] == [
        f"target names not checked: no manifests at {no_manifests} (set CORTEX_MANIFESTS to "
        "check them as the API will)", "valid"]
    code, out, err = invoke("--json", path)  # the note on stderr: stdout is only the report
    assert (code, json.loads(out)["errors"]) == (0, [])
    assert err.startswith("target names not checked")


@pytest.mark.usefixtures("example_manifests")
def test_with_manifests_it_rejects_what_the_api_rejects(tmp_path: Path) -> None:
    path = write(tmp_path, UNKNOWN_TOOL)
    expected = check_document(load_document(UNKNOWN_TOOL))  # what POST /v1/jobs answers
    assert [e["kind"] for e in expected] == ["unknown_tool"]
    code, out, report = validate_json(path)
    assert code == 1
    assert report["errors"] == expected
    code, out = validate(path)
    assert code == 1
    lines = out.splitlines()
    assert f"error 1:1 unknown_tool: {expected[0]['message']}" in lines
    assert lines[-1].startswith(f"targets checked against the manifests in {EXAMPLE_MANIFESTS} (")
    assert "valid" not in lines


@pytest.mark.usefixtures("example_manifests")
def test_with_manifests_a_document_of_shipped_tools_is_valid(tmp_path: Path) -> None:
    code, out = validate(write(tmp_path, UNKNOWN_TOOL.replace(
        '{"name": "no_such_tool"}', '{"name": "word_count", "parameters": {"path": "notes.md"}}')))
    assert code == 0
    assert out.splitlines()[-1] == "valid"
    assert out.splitlines()[-2].startswith("targets checked against the manifests in ")


def test_broken_manifests_stop_validate_with_their_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "tools.yaml").write_text("kind: Tool\nname: x\n", encoding="utf-8")
    monkeypatch.setenv("CORTEX_MANIFESTS", str(manifests))
    handles.reset()
    code, out, err = invoke(write(tmp_path, UNKNOWN_TOOL))
    assert code == 2
    assert err.startswith("invalid manifests: ") and "tools.yaml" in err
    assert out == ""


def test_long_lines_are_printed_whole_not_wrapped_at_80_columns(tmp_path: Path) -> None:
    """Output to a pipe or a file (CliRunner's, a log's) has no terminal width to wrap at."""
    ident = "a_rather_long_action_identifier_that_makes_the_error_line_run_past_eighty"
    doc = f'<action id="{ident}">{{"name": "t"}}</action><action id="{ident}">{{"name": "u"}}</action>'
    code, out = validate(write(tmp_path, doc))
    assert code == 1
    line = (f"error 1:{len(doc) // 2 + 1} duplicate_id: action id '{ident}' is already used in "
            "this job; give each action its own id")
    assert len(line) > 120
    assert line in out.splitlines()


def _commands(group: typer.main.TyperGroup, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, command in group.commands.items():
        if isinstance(command, typer.main.TyperGroup):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


def test_every_commands_help_reads_without_typer_placeholders() -> None:
    """No `<bool>` after a flag, and arguments as FILE or [KEY] in the usage line (typer 0.29
    writes `{file}` and `[key]`)."""
    root = typer.main.get_command(app)
    assert isinstance(root, typer.main.TyperGroup)
    seen = []
    for path in _commands(root):
        result = runner.invoke(app, [*path, "--help"], prog_name="cortex",
                               env={"COLUMNS": "120"})
        assert result.exit_code == 0, (path, result.output)
        text = ANSI.sub("", result.output)
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        assert "<bool>" not in text, path
        assert "{" not in usage, (path, usage)
        seen.append(" ".join(usage.split()))
    assert "Usage: cortex validate [OPTIONS] FILE" in seen
    assert "Usage: cortex exec [OPTIONS] FILE" in seen
    assert "Usage: cortex keys hash [OPTIONS] [KEY]" in seen
    assert "Usage: cortex approve [OPTIONS] JOB_ID ACTION_ID" in seen
    assert len(seen) == 13  # cortex, its 10 commands, keys' 2 (keys itself included above)
