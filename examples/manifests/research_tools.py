"""The demo agent's tools, written as Python functions (`@tool`): their parameters' JSON
Schema comes from the type hints, their description from the docstring. research_tools.yaml
(a `kind: ToolModule` manifest) makes them tools; they run in the tool sandbox like any
python tool, with the job's workspace as the working directory."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Annotated

from pydantic import Field

from cortex_worker.tools.function import tool

DOCS = Path(__file__).resolve().parent.parent / "docs"
"""The documents the demo agent researches (examples/docs)."""


@tool(timeout=30)
def top_words(path: Annotated[str, Field(description="file relative to the job workspace")],
              count: Annotated[int, Field(ge=1, le=1000)] = 10) -> list[dict[str, int | str]]:
    """The most frequent words of a text file in the job workspace."""
    words = re.findall(
        r"[a-zA-Z']+", Path(path).read_text(encoding="utf-8", errors="replace").lower()
    )
    return [{"word": w, "count": n} for w, n in Counter(words).most_common(count)]


@tool(timeout=30)
def load_docs(
    pattern: Annotated[str, Field(pattern=r"^[^/\\]+$",
                                  description='a glob, e.g. "a*.md"')] = "*.md",
    corpus: Annotated[str, Field(pattern=r"^[^/\\]*$",
                                 description='file for all texts; "" for none')] = "corpus.txt",
) -> dict[str, object]:
    """Copy the example documents (examples/docs/*.md) into `docs/` of the job workspace, and
    all of them into one file `corpus.txt`; returns {files: [{path, bytes, words}], count,
    words, corpus}.

    `pattern` and `corpus` are plain names: no `/` or `\\` (their schema), and not `..`."""
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
