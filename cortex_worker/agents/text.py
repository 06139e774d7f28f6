"""How prompts write values: JSON on one line, descriptions on one line."""

from __future__ import annotations

import json
from typing import Any


def compact(value: Any) -> str:
    """JSON without spaces (a schema in a prompt)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def one_line(text: str) -> str:
    """Whitespace, newlines included, folded to single spaces."""
    return " ".join(text.split())
