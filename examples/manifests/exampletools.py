"""An example python-runtime tool declared in YAML (see tools.yaml next to this file).

The demo agent's own tools are `@tool` functions: research_tools.py.
"""

from __future__ import annotations

import re
import unicodedata


def slugify(text: str, max_length: int = 64) -> str:
    """ "Hello, World!" -> "hello-world"."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[:max_length].rstrip("-")
