"""Fixes to the Redis transport of kombu that the chaos tests found; `install()` applies them.

- A worker whose broker connection drops closes its channels; the channel hands back the
  tasks it holds (`QoS.restore_unacked`) through a connection that kombu 5.7 has already torn
  down, and `AttributeError: 'NoneType' object has no attribute 'hostname'` ends the worker
  process (about 1 Redis restart in 3). Those tasks are still in kombu's unacked set in
  Redis, and its periodic sweep delivers them again after the visibility timeout, so the
  hand-back is skipped instead: the worker lives and nothing is lost.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

_installed = False


def install() -> None:
    """Apply the fixes (idempotent)."""
    global _installed
    if _installed:
        return
    original = kombu_redis.QoS.restore_unacked

    def restore_unacked(self: Any, client: Any = None) -> None:
        if client is None and getattr(self.channel.connection, "client", None) is None:
            log.warning("broker connection already closed: %d unacknowledged task(s) will be "
                        "delivered again after the visibility timeout", len(self._delivered))
            self._delivered.clear()
            return
        original(self, client)

    kombu_redis.QoS.restore_unacked = restore_unacked
    _installed = True
