"""The checkout is self-contained: a user's clone has nothing beside it and no one's machine paths."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from tests.manifest_helpers import CORPUS, REPO_ROOT

pytestmark = pytest.mark.unit

# A path out of the checkout (a sibling folder of the repository) or into a development machine.
OUTSIDE = re.compile(r"\.\./shared|\"shared\"|/work/|/home/\w+/|/Users/\w+/")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def test_no_file_reads_outside_the_checkout_or_names_a_machine_path() -> None:
    offenders = []
    for name in tracked_files():
        path = REPO_ROOT / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ""}:
            continue
        if name == "tests/unit/test_repository.py" or not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{name}:{lineno}: {line.strip()}")
    assert offenders == []


def test_the_protocol_corpus_lives_in_the_repository() -> None:
    assert CORPUS.is_relative_to(REPO_ROOT)
    assert len(list(CORPUS.glob("*.xml"))) == 9


def test_license_is_an_spdx_string() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
