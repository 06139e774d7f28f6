"""Files inside a job workspace: path confinement, read, write and grep.

Every path is relative to the workspace and must stay inside it after symlinks are
resolved; absolute paths and `..` escapes are refused with a ToolError.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from cortex_worker.tools.errors import ToolError

DEFAULT_READ_BYTES = 256 * 1024
MAX_LINE_CHARS = 500
BINARY_SNIFF = 8192
GREP_MAX_FILE_BYTES = 16 * 1024 * 1024
"""grep skips larger files (and binary ones: a NUL byte in the first BINARY_SNIFF bytes)."""


def resolve_in(workspace: Path, path: str) -> Path:
    """`workspace/path` resolved; refuses anything that ends up outside the workspace."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("path must be a non-empty string relative to the workspace")
    if "\x00" in path:
        raise ToolError("path must not contain NUL characters")
    if os.path.isabs(path) or path.startswith("~"):
        raise ToolError(
            f"path {path!r} is absolute (or starts with '~'); give a path relative to the workspace"
        )
    root = workspace.resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        lexical = Path(os.path.normpath(root / path))
        how = "through a symlink" if lexical.is_relative_to(root) else "with '..'"
        raise ToolError(f"path {path!r} escapes the workspace ({how})")
    return target


def relative(workspace: Path, target: Path) -> str:
    return target.relative_to(workspace.resolve()).as_posix() or "."


def read_text(workspace: Path, path: str, max_bytes: int = DEFAULT_READ_BYTES) -> dict[str, Any]:
    """{"path", "content", "size", "truncated"}; bytes beyond max_bytes are not read."""
    target = resolve_in(workspace, path)
    if not target.exists():
        raise ToolError(f"no file {path!r} in the workspace")
    if not target.is_file():
        raise ToolError(f"{path!r} is not a regular file")
    size = target.stat().st_size
    with _open(target, os.O_RDONLY) as fh:
        data = fh.read(max_bytes)
    return {
        "path": relative(workspace, target),
        "content": data.decode("utf-8", errors="replace"),
        "size": size,
        "truncated": size > len(data),
    }


def write_text(workspace: Path, path: str, content: str, append: bool = False) -> dict[str, Any]:
    """Write (or append) UTF-8 text, creating parent directories; {"path", "bytes"}."""
    target = resolve_in(workspace, path)
    if target.is_dir():
        raise ToolError(f"{path!r} is a directory")
    created = [d for d in reversed(target.parents) if d.is_relative_to(workspace.resolve())
               and not d.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    try:
        with _open(target, flags, "ab" if append else "wb") as fh:
            fh.write(data)
            _give_to_owner(workspace, [*created, target])
    except OSError as exc:
        raise ToolError(f"cannot write {path!r}: {exc.strerror}") from None
    return {"path": relative(workspace, target), "bytes": len(data), "appended": append}


def _give_to_owner(workspace: Path, paths: list[Path]) -> None:
    """What the worker creates in a workspace belongs to the workspace's owner (the user tool
    code runs as), so that tools may change it too."""
    owner = workspace.stat()
    if os.geteuid() == 0 and owner.st_uid != 0:
        for path in paths:
            os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)


def _open(target: Path, flags: int, mode: str = "rb") -> IO[bytes]:
    """Open without following a symlink swapped in after `resolve_in` checked the path."""
    try:
        fd = os.open(target, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise ToolError(f"cannot open {target.name!r}: {exc.strerror}") from None
    return os.fdopen(fd, mode)


def grep(
    workspace: Path,
    pattern: str,
    path: str = ".",
    max_matches: int = 100,
    ignore_case: bool = False,
) -> list[dict[str, Any]]:
    """[{"path", "line", "text"}] for lines matching `pattern` in the text files under `path`."""
    try:
        regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise ToolError(f"invalid regular expression {pattern!r}: {exc}") from None
    start = resolve_in(workspace, path)
    if not start.exists():
        raise ToolError(f"no file or directory {path!r} in the workspace")
    matches: list[dict[str, Any]] = []
    for file in _walk(workspace.resolve(), start):
        for number, text in _text_lines(file):
            if regex.search(text):
                matches.append(
                    {
                        "path": relative(workspace, file),
                        "line": number,
                        "text": text[:MAX_LINE_CHARS],
                    }
                )
                if len(matches) >= max_matches:
                    return matches
    return matches


def _walk(root: Path, start: Path) -> Iterator[Path]:
    """Regular files under `start` in sorted order, never leaving `root` through symlinks."""
    if start.is_file():
        yield start
        return
    for dirpath, dirnames, filenames in os.walk(start):
        dirnames.sort()
        for name in sorted(filenames):
            file = Path(dirpath) / name
            if file.is_symlink() and not file.resolve().is_relative_to(root):
                continue
            if file.is_file() and file.stat().st_size <= GREP_MAX_FILE_BYTES:
                yield file


def _text_lines(file: Path) -> Iterator[tuple[int, str]]:
    try:
        with file.open("rb") as fh:
            if b"\x00" in fh.read(BINARY_SNIFF):
                return
            fh.seek(0)
            for number, raw in enumerate(fh, start=1):
                yield number, raw.decode("utf-8", errors="replace").rstrip("\r\n")
    except OSError:
        return
