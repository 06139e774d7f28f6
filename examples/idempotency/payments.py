"""A tool whose side effect must happen once however often its action runs: `charge`.

Cortex runs an action at least once: a retry, or a worker that paused or died and whose action
was sent again, calls the tool again. Every attempt of an action has the same idempotency key
(`current().idempotency_key`, `<job_id>:<action_id>`), so the charge is recorded under it with
HSETNX: the first attempt to get there charges, any other answers that charge. With a real
payment provider, send the key as its idempotency key (Stripe's `Idempotency-Key` header).

    CORTEX_TOOL_MODULES=payments   # or payments.yaml, next to this file, in the manifests

See docs/manifests.md, "Idempotency: actions run at least once".
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from cortex_worker.tools.attempt import current
from cortex_worker.tools.function import tool

REDIS_URL = "redis://localhost:6379/0"
"""Where the charges are kept: a Redis every worker reaches."""
CHARGES = "payments:charges"
"""A hash: idempotency key -> the charge made under it."""


@tool(network=True)
def charge(card: str, cents: int) -> dict[str, Any]:
    """Charge `cents` to `card` once per action: a re-run answers the first charge."""
    attempt = current()
    made = {"card": card, "cents": cents, "attempt": attempt.attempt, "at": time.time()}
    client = redis.Redis.from_url(REDIS_URL)
    if client.hsetnx(CHARGES, attempt.idempotency_key, json.dumps(made)):
        return {**made, "charged": True}
    first = json.loads(client.hget(CHARGES, attempt.idempotency_key) or "{}")
    return {**first, "charged": False}  # an earlier attempt charged: not again
