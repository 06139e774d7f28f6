"""Tools written as Python functions (`@tool`), loaded by function_tools.yaml."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from cortex_worker.tools.function import tool


class Point(BaseModel):
    x: float
    y: float


@tool
def distance(a: Point, b: Point) -> float:
    """Distance between two points.

    Both are objects with `x` and `y`."""
    return round(((a.x - b.x) ** 2 + (a.y - b.y) ** 2) ** 0.5, 6)


@tool(timeout=5)
async def shout(text: str, times: int = 1) -> dict[str, str]:
    """Upper-case `text`, `times` times."""
    await asyncio.sleep(0)
    return {"said": " ".join([text.upper()] * times)}
