"""Example python-runtime tools (see tools.yaml next to this file)."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path


def slugify(text: str, max_length: int = 64) -> str:
    """ "Hello, World!" -> "hello-world"."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[:max_length].rstrip("-")


def top_words(path: str, count: int = 10) -> list[dict[str, int | str]]:
    """The `count` most frequent words of a text file in the workspace (the working directory)."""
    words = re.findall(
        r"[a-zA-Z']+", Path(path).read_text(encoding="utf-8", errors="replace").lower()
    )
    return [{"word": w, "count": n} for w, n in Counter(words).most_common(count)]


DOCS = Path(__file__).resolve().parent.parent / "docs"
"""The documents the demo agent researches (examples/docs)."""


def load_docs(pattern: str = "*.md", corpus: str = "corpus.txt") -> dict[str, object]:
    """Copy the example documents matching `pattern` into `docs/` of the workspace (the cwd).

    Also writes all of them, one after another, into `corpus` (unless it is ""), for tools
    that read one file. Returns the files copied with their sizes, and the totals.
    """
    for name, value in (("pattern", pattern), ("corpus", corpus)):
        if "/" in value or "\\" in value or value.startswith(".."):
            raise ValueError(f"{name} must be a plain file name or glob, not {value!r}")
    target = Path("docs")
    target.mkdir(exist_ok=True)
    files, texts = [], []
    for source in sorted(DOCS.glob(pattern)):
        if not source.is_file():
            continue
        text = source.read_text(encoding="utf-8")
        (target / source.name).write_text(text, encoding="utf-8")
        texts.append(text)
        files.append({"path": f"docs/{source.name}", "bytes": len(text.encode("utf-8")),
                      "words": len(text.split())})
    if not files:
        raise ValueError(f"no document in {DOCS} matches {pattern!r}")
    if corpus:
        Path(corpus).write_text("\n".join(texts), encoding="utf-8")
    return {"files": files, "count": len(files), "words": sum(f["words"] for f in files),
            "corpus": corpus or None}
