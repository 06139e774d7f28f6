"""The `replay` provider: plays a recorded transcript instead of calling a model.

A transcript is a YAML or JSON file (`.json` is read as JSON, anything else as YAML):

    turns:
      - |
        <thought>...</thought> ...      # the protocol text of turn 1
      - |
        <response final="true">...</response>

The turn played is the number of `assistant` messages already in the conversation (turn 1
for the first request). Its text is streamed as `TextDelta`s of 4 characters (one "token"
each) at `config.tokens_per_second`, on a monotonic schedule, then a `Usage` estimated as
characters / 4. Note that the coordinator ends a generation at a sync action: a transcript
turn should stop at its first sync action, and the next turn continues from there.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.stream import ModelError, Piece, TextDelta, Usage

__all__ = ["CHARS_PER_TOKEN", "find_transcript", "load_transcript", "replay_stream"]

CHARS_PER_TOKEN = 4

_cache: dict[Path, tuple[float, int, list[str]]] = {}
_cache_lock = threading.Lock()
_sleep = time.sleep  # tests may replace it


def find_transcript(transcript: str, base_dir: str | Path | None = None) -> Path:
    """Resolve a transcript path: absolute, relative to the CWD, or relative to `base_dir`."""
    path = Path(transcript).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path]
    if base_dir is not None and not path.is_absolute():
        candidates.append(Path(base_dir) / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise ModelError(f"replay transcript {transcript!r} not found (looked for {looked}); "
                     "fix `transcript:` in the agent's model settings")


def load_transcript(path: Path) -> list[str]:
    """The turns of a transcript file (cached until the file changes)."""
    try:
        stat = path.stat()
        with _cache_lock:
            cached = _cache.get(path)
        if cached and cached[:2] == (stat.st_mtime, stat.st_size):
            return cached[2]
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"cannot read replay transcript {path}: {exc}") from None
    try:
        data: Any = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ModelError(f"replay transcript {path} is not valid "
                         f"{'JSON' if path.suffix.lower() == '.json' else 'YAML'}: {exc}") from None
    turns = data.get("turns") if isinstance(data, dict) else data
    if not isinstance(turns, list) or not turns:
        raise ModelError(f"replay transcript {path} must be a mapping with a non-empty list "
                         "'turns' (the protocol text of each turn)")
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, str):
            raise ModelError(f"replay transcript {path}: turn {number} must be a string of "
                             f"protocol text, not {type(turn).__name__}")
    with _cache_lock:
        _cache[path] = (stat.st_mtime, stat.st_size, turns)
    return turns


def replay_stream(
    config: ModelConfig,
    messages: list[dict[str, Any]],
    *,
    base_dir: str | Path | None = None,
) -> Iterator[Piece]:
    """Stream the transcript's turn for this conversation (see the module docstring).

    Like `stream_chat`, a generator: errors are raised by the first `next()`.
    """
    if not config.transcript:
        raise ModelError("model provider 'replay' needs `transcript:` (a YAML or JSON file with "
                         "a list 'turns')")
    path = find_transcript(config.transcript, base_dir)
    turns = load_transcript(path)
    index = sum(1 for m in messages if m.get("role") == "assistant")
    if index >= len(turns):
        raise ModelError(f"replay transcript {path} has only {len(turns)} turns; the conversation "
                         f"asks for turn {index + 1}")
    yield from _play(turns[index], messages, config.tokens_per_second)


def _play(text: str, messages: list[dict[str, Any]], tokens_per_second: float) -> Iterator[Piece]:
    interval = 1.0 / tokens_per_second
    start = time.monotonic()
    for number, offset in enumerate(range(0, len(text), CHARS_PER_TOKEN)):
        delay = start + number * interval - time.monotonic()
        if delay > 0:
            _sleep(delay)
        yield TextDelta(text[offset:offset + CHARS_PER_TOKEN])
    prompt_chars = sum(len(_content_text(m.get("content"))) for m in messages)
    prompt = math.ceil(prompt_chars / CHARS_PER_TOKEN)
    completion = math.ceil(len(text) / CHARS_PER_TOKEN)
    yield Usage(prompt, completion, prompt + completion)


def _content_text(content: Any) -> str:
    """The text of a message's content: a string or a list of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
