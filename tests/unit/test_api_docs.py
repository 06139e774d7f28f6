"""docs/api.md is generated from the OpenAPI spec: it must match the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_is_up_to_date() -> None:
    generated = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api_docs.py")],
                               capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert generated == (ROOT / "docs" / "api.md").read_text(), (
        "docs/api.md is stale: run `.venv/bin/python scripts/gen_api_docs.py > docs/api.md`")
