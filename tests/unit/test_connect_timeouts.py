"""Every Redis client Cortex builds bounds its reads and keeps its connections alive, so a
master that froze (SIGSTOP, a paused VM, a partition: its connections stay open) holds no
command, BRPOP or request for good (cortex_worker/store/connect.py). The frozen master
itself is in tests/integration/test_sentinel.py (`test_the_master_frozen_under_load`)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from kombu.transport.redis import Channel as KombuChannel
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from cortex_api.sse import EventHub
from cortex_worker.app import create_app
from cortex_worker.settings import Settings
from cortex_worker.store.connect import (
    BROKER_HEALTH_CHECK_S,
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    celery_socket_options,
    keepalive_options,
    sync_client,
)
from cortex_worker.store.state import Store
from tests.manifest_helpers import TEST_MANIFESTS

pytestmark = pytest.mark.unit

SENTINEL_URL = "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/cortex/0"
PLAIN_URL = "redis://127.0.0.1:6379/0"


def _bounded(kwargs: dict[str, Any], read_timeout: float) -> None:
    assert kwargs["socket_timeout"] == read_timeout
    assert kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_S
    assert kwargs["socket_keepalive"] is True
    assert kwargs["socket_keepalive_options"] == keepalive_options()


def test_keepalive_probes_an_idle_connection_within_seconds() -> None:
    options = keepalive_options()
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; other platforms get what they have
        assert options[socket.TCP_KEEPIDLE] == 10
        assert options[socket.TCP_KEEPINTVL] == 5
        assert options[socket.TCP_KEEPCNT] == 3
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        assert options[socket.TCP_USER_TIMEOUT] == 25_000


@pytest.mark.parametrize("url", [SENTINEL_URL, PLAIN_URL])
def test_the_stores_reads_outlast_the_replicas_wait(url: str) -> None:
    """A write's WAIT may take `redis_replica_wait_ms`: the read timeout is that and more."""
    for wait_ms in (1000, 4000):
        store = Store.from_url(url, replica_wait_ms=wait_ms)
        try:
            _bounded(store.redis.connection_pool.connection_kwargs,
                     READ_TIMEOUT_S + wait_ms / 1000)
        finally:
            store.redis.close()


def test_a_broken_connection_reconnects_with_one_look_at_the_sentinels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's retry makes the next attempts: a reconnect that retried too would try
    a frozen master the sentinels still name retries x retries times, each for its timeout."""
    client = sync_client(SENTINEL_URL, retry=Retry(NoBackoff(), 5), max_connections=2,
                         pool_timeout=1.0)
    looks: list[str] = []

    def no_master(service_name: str) -> tuple[str, int]:
        looks.append(service_name)
        raise MasterNotFoundError(f"No master found for {service_name!r}")

    monkeypatch.setattr(client.connection_pool.sentinel_manager, "discover_master", no_master)
    connection = client.connection_pool.make_connection()
    with pytest.raises(MasterNotFoundError):
        connection.send_command("PING")  # reconnects as a resent command does
    assert looks == ["cortex"]
    with pytest.raises(MasterNotFoundError):
        connection.connect()  # a connection taken from the pool: retried, as before
    assert len(looks) == 1 + 6


@pytest.mark.parametrize("url", [SENTINEL_URL, PLAIN_URL])
def test_the_event_hubs_clients_are_bounded_pub_sub_included(url: str) -> None:
    """Replays, readiness and the pub/sub connection (whose reads pass the hub's own poll
    timeout, so an idle subscription does not time out)."""
    hub = EventHub.from_url(url)
    for client in (hub.redis, hub._master, hub._pubsub_client):
        assert client is not None
        _bounded(client.connection_pool.connection_kwargs, READ_TIMEOUT_S)


def test_a_unix_socket_client_gets_the_timeouts_without_tcp_options(tmp_path: Any) -> None:
    store = Store.from_url(f"unix://{tmp_path}/redis.sock?db=1")
    pool = store.redis.connection_pool
    assert pool.connection_kwargs["socket_timeout"] == READ_TIMEOUT_S + 1.0
    assert "socket_keepalive" not in pool.connection_kwargs
    pool.make_connection()  # a TCP option here would be a TypeError at the first command


@pytest.mark.parametrize("url", [SENTINEL_URL, PLAIN_URL])
def test_the_broker_is_bounded_and_checked_often(url: str) -> None:
    app = create_app(Settings(redis_url=url, manifests=TEST_MANIFESTS))
    options = app.conf.broker_transport_options
    _bounded(options, READ_TIMEOUT_S)
    assert options["health_check_interval"] == BROKER_HEALTH_CHECK_S
    # kombu's Redis channel (and its Sentinel channel) reads each of them
    assert {"socket_timeout", "socket_connect_timeout", "socket_keepalive",
            "socket_keepalive_options", "health_check_interval"} <= set(
                KombuChannel.from_transport_options)
    assert options["visibility_timeout"] == app.conf.result_backend_transport_options[
        "visibility_timeout"]


@pytest.mark.parametrize("url", [SENTINEL_URL, PLAIN_URL])
def test_the_result_backend_is_bounded_too(url: str) -> None:
    """Celery reads its result backend's socket settings from app.conf (its read timeout is
    120 s otherwise): chords join there."""
    app = create_app(Settings(redis_url=url, manifests=TEST_MANIFESTS))
    assert (app.conf.redis_socket_timeout, app.conf.redis_socket_connect_timeout,
            app.conf.redis_socket_keepalive, app.conf.redis_backend_health_check_interval) \
        == (READ_TIMEOUT_S, CONNECT_TIMEOUT_S, True, BROKER_HEALTH_CHECK_S)
    backend = app.backend.connparams if url == PLAIN_URL else None
    if backend is not None:  # as the backend connects
        assert backend["socket_timeout"] == READ_TIMEOUT_S
        assert backend["socket_keepalive"] is True
        assert backend["health_check_interval"] == BROKER_HEALTH_CHECK_S


def test_another_broker_gets_no_redis_options() -> None:
    assert celery_socket_options("amqp://guest:guest@rabbit:5672//") == {}
    assert "socket_keepalive" not in celery_socket_options("unix:///run/redis.sock")
