"""The README's commands name files that exist, and the document it runs runs on the tools
that ship with Cortex (a new user has no others)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from cortex_worker import handles
from cortex_worker.jobs import lifecycle
from cortex_worker.protocol.document import load_document
from tests.manifest_helpers import EXAMPLE_MANIFESTS, REPO_ROOT

pytestmark = pytest.mark.unit

README = (REPO_ROOT / "README.md").read_text()
COMMANDS = re.findall(r"cortex (exec|validate)(?: --json)? (\S+)", README)


@pytest.fixture
def example_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CORTEX_MANIFESTS", str(EXAMPLE_MANIFESTS))
    handles.reset()
    yield
    handles.reset()


def test_the_readme_runs_and_validates_files_that_exist() -> None:
    assert {command for command, _ in COMMANDS} == {"exec", "validate"}
    for _, path in COMMANDS:
        assert (REPO_ROOT / path).is_file(), path


@pytest.mark.usefixtures("example_registry")
def test_the_document_the_readme_runs_needs_only_the_shipped_manifests() -> None:
    for command, path in COMMANDS:
        if command == "exec":
            document = load_document((REPO_ROOT / path).read_text())
            assert lifecycle.check_document(document) == [], path
