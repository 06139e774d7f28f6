"""A Redis URL shown in a message, a log or by the CLI (`cortex up`) never shows a password:
neither its user part's (one, before the first host of a Sentinel URL) nor its query's
(`password=`, a Sentinel URL's `sentinel_password=`) (`cortex_worker.store.connect.redact`)."""

from __future__ import annotations

import pytest

from cortex_api.cli import _redact
from cortex_worker.store.connect import redact

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("url", "shown"), [
    ("redis+sentinel://:hunter2@h1:26379,h2:26379/cortex/0?sentinel_password=hunter3",
     "redis+sentinel://:***@h1:26379,h2:26379/cortex/0?sentinel_password=***"),
    ("redis+sentinel://cortex:hunter2@[::1]:26379,h2/cortex",
     "redis+sentinel://cortex:***@[::1]:26379,h2/cortex"),
    ("redis+sentinel://h1,h2/cortex/0?SENTINEL_PASSWORD=hunter3",
     "redis+sentinel://h1,h2/cortex/0?SENTINEL_PASSWORD=***"),
    ("redis://:hun%40ter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://:hunter2@host?db=1&password=hunter3", "redis://:***@host?db=1&password=***"),
    ("redis://127.0.0.1:6379/0?password=hunter3", "redis://127.0.0.1:6379/0?password=***"),
    ("redis://:hun?ter#2@host/0", "redis://:***@host/0"),
    ("amqp://guest:hunter2@rabbit:5672//", "amqp://guest:***@rabbit:5672//"),
    ("sentinel://:hunter2@h1:1/0;sentinel://:hunter2@h2:2/0",
     "sentinel://:***@h1:1/0;sentinel://:***@h2:2/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://cortex@127.0.0.1:6379/0", "redis://cortex@127.0.0.1:6379/0"),
])
def test_the_cli_never_shows_a_password(url: str, shown: str) -> None:
    assert _redact(url) == redact(url) == shown
    assert "hunter" not in shown and "ter2" not in shown
