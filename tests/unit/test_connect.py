"""Redis URLs (cortex_worker/store/connect.py): a Sentinel URL parsed, or refused naming the
part that is wrong; the clients and the Celery configuration built from it; and the API's
answers when Redis is read-only or unreachable (503 with the reason, /readyz not ready).
Failover itself is tested with real sentinels in tests/integration/test_sentinel.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, SentinelConnectionPool

from cortex_api import readiness
from cortex_api.app import create_app as create_api
from cortex_api.readiness import ReadinessProbe
from cortex_worker.app import create_app
from cortex_worker.pools import NAMES
from cortex_worker.settings import Settings
from cortex_worker.store.connect import (
    DEFAULT_SENTINEL_PORT,
    PlainTarget,
    RedisUrlError,
    SentinelTarget,
    celery_backend_config,
    celery_broker_config,
    describe,
    parse_url,
    read_only_reason,
    sync_client,
)
from tests.manifest_helpers import TEST_MANIFESTS

SENTINEL_URL = "redis+sentinel://:s%40cret@10.0.0.1:26380,10.0.0.2,[::1]:26381/cortex/3"


def test_a_sentinel_url_is_parsed() -> None:
    target = parse_url(SENTINEL_URL + "?sentinel_password=guard")
    assert isinstance(target, SentinelTarget)
    assert target.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", DEFAULT_SENTINEL_PORT),
                                ("::1", 26381))
    assert (target.master_name, target.db) == ("cortex", 3)
    assert target.master_kwargs() == {"db": 3, "password": "s@cret"}
    assert target.sentinel_kwargs()["password"] == "guard"
    assert "s@cret" not in repr(target) and "guard" not in repr(target)


def test_the_db_and_the_password_are_optional() -> None:
    target = parse_url("redis+sentinel://h1:1,h2:2/mymaster")
    assert isinstance(target, SentinelTarget)
    assert target.master_kwargs() == {"db": 0}
    assert "password" not in target.sentinel_kwargs()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://:pw@host:6380/1",
                                 "unix:///run/redis.sock?db=2"])
def test_a_plain_url_is_used_as_it_is(url: str) -> None:
    assert parse_url(url) == PlainTarget(url=url)
    assert celery_broker_config(url) == {"broker_url": url, "broker_transport_options": {}}
    assert celery_backend_config(url)["result_backend"] == url


@pytest.mark.parametrize(("url", "names"), [
    ("redis+sentinel://h1:1,h2:2/", "master's name is missing"),
    ("redis+sentinel://h1:1,h2:2", "master's name is missing"),
    ("redis+sentinel://h1:port/m/0", "sentinel 'h1:port' has a bad port 'port'"),
    ("redis+sentinel://h1:70000/m/0", "bad port '70000'"),
    ("redis+sentinel://h1:1,,h2:2/m/0", "a sentinel's host is empty"),
    ("redis+sentinel://h1:1/m/zero", "the db must be a number >= 0 (got 'zero')"),
    ("redis+sentinel://h1:1/m/0/extra", "the path is /MASTER_NAME or /MASTER_NAME/DB"),
    ("redis+sentinel://h1:1/m/0?timeout=3", "unknown option(s) timeout"),
    ("redis+sentinel://[::1/m", "Invalid IPv6 URL"),
    ("redis+sentinel://[::1]x/m", "bad sentinel address '[::1]x'"),
    ("sentinel://h1:1/m", "a Redis URL starts with redis://"),
    ("127.0.0.1:6379", "a Redis URL starts with redis://"),
])
def test_a_malformed_url_names_the_wrong_part(url: str, names: str) -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse_url(url)
    assert names in str(caught.value)


def test_messages_never_show_a_password() -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse_url("redis+sentinel://:hunter2@h1:1/?sentinel_password=hunter3")
    assert "hunter2" not in str(caught.value) and "hunter3" not in str(caught.value)


def test_settings_refuse_a_malformed_url_at_start() -> None:
    with pytest.raises(ValidationError, match="the master's name is missing"):
        Settings(redis_url="redis+sentinel://h1:1,h2:2/")
    with pytest.raises(ValidationError, match="bad port"):
        Settings(broker_url="redis+sentinel://h1:x/m")
    assert Settings(broker_url="amqp://guest@rabbit//").broker == "amqp://guest@rabbit//"


def test_celery_gets_kombus_sentinel_urls_and_the_master_name() -> None:
    broker = celery_broker_config(SENTINEL_URL)
    assert broker["broker_url"] == ("sentinel://:s%40cret@10.0.0.1:26380/3;"
                                    "sentinel://:s%40cret@10.0.0.2:26379/3;"
                                    "sentinel://:s%40cret@[::1]:26381/3")
    assert broker["broker_transport_options"]["master_name"] == "cortex"
    backend = celery_backend_config(SENTINEL_URL)
    assert backend["result_backend"] == broker["broker_url"]
    assert backend["result_backend_transport_options"]["master_name"] == "cortex"


def test_the_celery_app_uses_the_sentinel_transport_with_cortex_options() -> None:
    app = create_app(Settings(redis_url="redis+sentinel://127.0.0.1:1,127.0.0.1:2/cortex/0",
                              manifests=TEST_MANIFESTS))
    options = app.conf.broker_transport_options
    assert options["master_name"] == "cortex" and "visibility_timeout" in options
    assert app.conf.result_backend_transport_options["master_name"] == "cortex"
    with app.connection_for_write() as connection:
        assert connection.transport_cls == "sentinel"
        assert connection.alt == ["sentinel://127.0.0.1:1/0", "sentinel://127.0.0.1:2/0"]
    assert type(app.backend).__name__ == "SentinelBackend"


def test_a_sentinel_client_has_a_blocking_pool_on_the_named_master() -> None:
    client = sync_client(SENTINEL_URL, retry=Retry(NoBackoff(), 2), max_connections=7,
                         pool_timeout=3.0)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert isinstance(pool, redis.BlockingConnectionPool)
    assert (pool.service_name, pool.max_connections, pool.timeout) == ("cortex", 7, 3.0)
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "s@cret"
    assert pool.connection_kwargs["decode_responses"] is True
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 26381)]


def test_a_plain_client_keeps_todays_pool() -> None:
    client = sync_client("redis://127.0.0.1:6379/2", retry=Retry(NoBackoff(), 2),
                         max_connections=9, pool_timeout=4.0)
    pool = client.connection_pool
    assert type(pool) is redis.BlockingConnectionPool
    assert (pool.max_connections, pool.timeout, pool.connection_kwargs["db"]) == (9, 4.0, 2)


def test_a_replica_is_read_only_and_names_its_master() -> None:
    assert read_only_reason(["master", 10, []]) is None
    assert read_only_reason(["slave", "10.0.0.9", 6379, "connected", 10]) == (
        "Redis is read-only (a replica of 10.0.0.9:6379)")


# ---------------------------------------------------------------- the API's answers


@pytest.fixture
def api() -> Any:
    """The real app, without its lifespan (so no Redis)."""
    return create_api(Settings(manifests=TEST_MANIFESTS))


@pytest.mark.parametrize(("error", "message"), [
    (ReadOnlyError("You can't write against a read only replica."),
     "Redis is read-only (a replica): You can't write against a read only replica."),
    (RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
     "Redis is unavailable: Error 111 connecting to 127.0.0.1:6379. Connection refused."),
])
def test_redis_errors_are_503_with_the_reason(api: Any, error: Exception, message: str) -> None:
    def fail() -> None:
        raise error

    api.add_api_route("/test/fail", fail, methods=["POST"])
    response = TestClient(api).post("/test/fail")
    assert response.status_code == 503
    assert response.json() == {"detail": {"message": message}}
    assert response.headers["retry-after"]


def test_readiness_names_a_read_only_redis() -> None:
    async def replica() -> bool:
        raise ReadOnlyError("Redis is read-only (a replica of 10.0.0.9:6379)")

    probe = ReadinessProbe(replica, lambda: {"agent": 1, "tool": 1}, ["agent", "tool"])
    try:
        result = asyncio.run(probe.check())
    finally:
        probe.close()
    assert (result.status, result.redis) == ("not_ready", False)
    assert result.error == "redis: Redis is read-only (a replica of 10.0.0.9:6379)"


def test_an_inspect_that_failed_is_made_again_on_a_new_broker_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu does not send a command that timed out again: the control app of a probe that
    failed (a connection left open to a frozen master) is closed, and the next probe builds
    another, instead of failing on the old connection again."""
    apps: list[Any] = []

    class App:
        def __init__(self) -> None:
            self.closed = False
            self.control = SimpleNamespace(inspect=lambda timeout: SimpleNamespace(
                active_queues=self.active_queues))
            apps.append(self)

        def active_queues(self) -> dict[str, Any]:
            if len(apps) == 1:
                raise RedisTimeoutError("Timeout reading from socket")
            return {"tool@a": [{"name": "tool"}], "agent@a": [{"name": "agent"}]}

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(readiness, "create_app", lambda settings: App())
    inspect = readiness.celery_inspector(Settings(manifests=TEST_MANIFESTS), timeout=1.0)
    with pytest.raises(RedisTimeoutError):
        inspect()
    assert inspect() == {**dict.fromkeys(NAMES, 0), "tool": 1, "agent": 1}
    assert [app.closed for app in apps] == [True, False]
    assert inspect()["tool"] == 1 and len(apps) == 2  # a working app is kept


def test_no_master_found_is_one_line() -> None:
    error = MasterNotFoundError("No master found for 'cortex' : <redis.client.Redis(...)> - "
                                "ConnectionError")
    assert describe(error) == ("No master found for 'cortex' (no sentinel answered, or none "
                               "names a master that is up)")
    assert describe(RedisConnectionError()) == "ConnectionError"
