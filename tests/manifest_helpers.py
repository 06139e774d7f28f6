"""Helpers shared by the manifest-loading tests: paths, writing a manifest, its error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from cortex_worker.manifests.loader import ManifestError, load_registry

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "tests" / "corpus"  # the protocol corpus, kept in the repository
TEST_MANIFESTS = REPO_ROOT / "tests" / "manifests"
EXAMPLE_MANIFESTS = REPO_ROOT / "examples" / "manifests"
TEST_AGENTS = sorted([
    "analyzer", "blocked", "cautious", "claude_tester", "clock", "comprehensive_analyzer",
    "continuer", "correlation_analyzer", "data_analyzer", "error_analyzer", "feed_lab", "feeder",
    "hasty", "helper", "llm_feeder", "must_act", "must_calculate", "native", "native_clock",
    "pattern_analyzer", "reporter", "retrier", "shallow", "tester"])
"""The agents of tests/manifests/agents.yaml (and `clock`, `native_clock`, of mcp.yaml), sorted as the API
lists them."""
TEST_RELICS = ["broken", "echo", "log_service", "missing", "postgres_monitor", "results_cache"]
"""The relics of tests/manifests/relics.yaml, sorted."""


def write(directory: Path, name: str, text: str) -> Path:
    """Write a (dedented) manifest file, creating its folders."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def load_error(directory: Path) -> str:
    """The message of the ManifestError that loading `directory` raises."""
    with pytest.raises(ManifestError) as info:
        load_registry(directory)
    return str(info.value)
