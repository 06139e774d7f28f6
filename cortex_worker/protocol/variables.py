"""Variable references in action parameters and response text: finding and substituting them.

Grammar (ASCII only):

* ``$name`` or ``${name}``, where a name is ``[A-Za-z_][A-Za-z0-9_]*``;
* optionally followed by path segments, ``$name.field.0`` / ``${name.field.0}``: a segment is
  ``.`` followed by an identifier or by digits that are not followed by a letter, digit or ``_``
  (so ``$x.0abc`` is ``$x`` followed by the text ``.0abc``). A ``.`` not followed by a segment is
  not part of the reference: ``"see $x."`` references ``x`` and keeps the dot;
* ``$$`` is a literal ``$`` (pairs are taken left to right, so ``$$$x`` is ``$`` then ``$x``);
* anything else is text: ``$5``, a lone ``$``, and a malformed ``${`` (unterminated or with
  anything but a name and path inside) are left as written. Scanning resumes right after such a
  ``$``, so in ``${$x}`` the inner ``$x`` is still a reference.

Substitution: a string that is exactly one reference takes the referenced value with its own type
(dict, list, int, None...). A reference inside a longer string becomes text: strings as they are,
anything else as ``json.dumps(value, ensure_ascii=False, default=str)`` (default separators, e.g.
``{"a": 1}``). A reference whose root is not in the lookup, or whose path does not resolve, is
left exactly as written and reported as `Unresolved` (one entry per occurrence, in order).
Whole-value substitution inserts the looked-up object itself, without copying it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from cortex_worker.errors import CortexError

__all__ = [
    "PathError",
    "Reference",
    "Unresolved",
    "find_references",
    "iter_references",
    "render",
    "resolve_path",
    "substitute",
]

_NAME = r"[A-Za-z_]\w*"
_PATH = rf"(?:\.(?:{_NAME}|\d+(?!\w)))*"
_TOKEN = re.compile(
    rf"\$\$|\$\{{(?P<bname>{_NAME})(?P<bpath>{_PATH})\}}|\$(?P<name>{_NAME})(?P<path>{_PATH})",
    re.ASCII,
)

UNKNOWN = "unknown variable"


@dataclass(frozen=True, slots=True)
class Reference:
    """One reference found in a string."""

    name: str  # root variable name
    path: tuple[str, ...]  # segments after the root, as written
    start: int  # span of the reference in the string
    end: int
    text: str  # exactly as written, e.g. "${a.b}"


class Unresolved(NamedTuple):
    """A reference left as written, and why, e.g. ``("$x.y", "no field 'y' in $x")``."""

    text: str
    reason: str


class PathError(CortexError, ValueError):
    """A path does not resolve; `reason` says why and `index` which segment failed."""

    def __init__(self, reason: str, index: int, path: Sequence[str]) -> None:
        super().__init__(f"{reason} (at segment {index} of path {'.'.join(path)!r})")
        self.reason = reason
        self.index = index


def _reference(m: re.Match[str]) -> Reference | None:
    name = m["name"] or m["bname"]
    if name is None:  # "$$"
        return None
    path = m["path"] if m["name"] else m["bpath"]
    segments = tuple(path[1:].split(".")) if path else ()
    return Reference(name, segments, m.start(), m.end(), m[0])


def iter_references(text: str) -> Iterator[Reference]:
    """Yield the references in `text`, left to right (``$$`` escapes are skipped)."""
    if "$" not in text:
        return
    for m in _TOKEN.finditer(text):
        ref = _reference(m)
        if ref is not None:
            yield ref


def find_references(value: Any) -> set[str]:
    """Root names referenced anywhere in a JSON-like value (dict values, not keys; lists; strings)."""
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.update(ref.name for ref in iter_references(item))
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return found


def resolve_path(value: Any, path: Sequence[str]) -> Any:
    """Follow `path` into `value`: dict keys by string, list items by digit index.

    Raises `PathError` for a missing key, an index out of range, or a non-container.
    """
    for i, seg in enumerate(path):
        if isinstance(value, Mapping):
            if seg not in value:
                raise PathError(f"no field {seg!r}", i, path)
            value = value[seg]
        elif isinstance(value, list | tuple):
            if not (seg.isascii() and seg.isdigit()):
                raise PathError(f"cannot look up field {seg!r} in a list", i, path)
            index = int(seg)
            if index >= len(value):
                raise PathError(f"index {index} out of range (length {len(value)})", i, path)
            value = value[index]
        else:
            raise PathError(f"cannot look up {seg!r} in {type(value).__name__}", i, path)
    return value


_MISSING = object()


def _lookup(ref: Reference, lookup: Mapping[str, Any], unresolved: list[Unresolved]) -> Any:
    """The referenced value, or `_MISSING` (after recording why)."""
    if ref.name not in lookup:
        unresolved.append(Unresolved(ref.text, UNKNOWN))
        return _MISSING
    try:
        return resolve_path(lookup[ref.name], ref.path)
    except PathError as e:
        where = "".join(f".{s}" for s in ref.path[: e.index])
        unresolved.append(Unresolved(ref.text, f"{e.reason} in ${ref.name}{where}"))
        return _MISSING


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _render(text: str, lookup: Mapping[str, Any], unresolved: list[Unresolved]) -> str:
    if "$" not in text:
        return text

    def replace(m: re.Match[str]) -> str:
        ref = _reference(m)
        if ref is None:
            return "$"
        value = _lookup(ref, lookup, unresolved)
        return m[0] if value is _MISSING else _as_text(value)

    return _TOKEN.sub(replace, text)


def _substitute(value: Any, lookup: Mapping[str, Any], unresolved: list[Unresolved]) -> Any:
    if isinstance(value, str):
        if "$" not in value:
            return value
        m = _TOKEN.match(value)
        if m is not None and m.end() == len(value) and (ref := _reference(m)) is not None:
            found = _lookup(ref, lookup, unresolved)
            return value if found is _MISSING else found
        return _render(value, lookup, unresolved)
    if isinstance(value, Mapping):
        return {k: _substitute(v, lookup, unresolved) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, lookup, unresolved) for v in value]
    if isinstance(value, tuple):
        return tuple(_substitute(v, lookup, unresolved) for v in value)
    return value


def substitute(value: Any, lookup: Mapping[str, Any]) -> tuple[Any, list[Unresolved]]:
    """Replace references in a JSON-like value (parameters); returns a new value and what failed.

    A string that is exactly one reference gets the typed value; other strings get text.
    Dict keys are not substituted; non-string scalars are returned unchanged.
    """
    unresolved: list[Unresolved] = []
    return _substitute(value, lookup, unresolved), unresolved


def render(text: str, lookup: Mapping[str, Any]) -> tuple[str, list[Unresolved]]:
    """Substitute references in response text, always as text; ``$$`` becomes ``$``."""
    unresolved: list[Unresolved] = []
    return _render(text, lookup, unresolved), unresolved
