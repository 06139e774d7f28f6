"""A Redis master, its replica and three sentinels on loopback free ports, for the tests of
Cortex behind Sentinel (`SentinelCluster`). Every process is a `harness.Process` (its own
group, logged, reaped with the rest); the sentinels are `redis-server --sentinel` with a
config file written here, so no `redis-sentinel` binary is needed.

    with SentinelCluster(tmp_path) as cluster:
        env["CORTEX_REDIS_URL"] = cluster.url       # redis+sentinel://.../cortex/0
        old = cluster.kill_master()
        new = cluster.wait_failover(old)            # the replica, promoted

`SentinelCluster(tmp_path, replica_delay_s=0.4, failover_timeout_ms=600_000)` makes the replica
lag: it replicates through a `DelayingProxy` that holds the master's stream for 0.4 s, and
whatever the proxy still holds when the master dies never reaches the replica (as bytes in
flight to a replica are lost when the master's machine goes).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests import harness

MASTER_NAME = "cortex"
QUORUM = 2
SENTINELS = 3


def _client(port: int) -> redis.Redis:
    """A client that fails at once (the tests wait with `wait_until`, not with retries)."""
    return redis.Redis(host=harness.LOOPBACK, port=port, socket_connect_timeout=0.5,
                       socket_timeout=1.0, retry=Retry(NoBackoff(), 0), decode_responses=True)


def in_sync(port: int) -> bool:
    """The replica on `port` has its link to its master up (its first sync done)."""
    client = _client(port)
    try:
        return client.info("replication").get("master_link_status") == "up"
    except redis.RedisError:
        return False
    finally:
        client.close()


def role(port: int) -> str | None:
    """The `ROLE` of the node on `port` ("master", "slave", "sentinel"), None if it is down."""
    client = _client(port)
    try:
        return str(client.execute_command("ROLE")[0])
    except redis.RedisError:
        return None
    finally:
        client.close()


class DelayingProxy:
    """A TCP proxy on loopback in front of `upstream_port` (a master) for its replica: every
    byte the upstream sends is held `delay_s` before it is passed on (the replica lags by
    that much, as over a slow or congested link), bytes the other way go at once (the
    replica's acknowledgements, REPLCONF ACK, are not delayed: WAIT sees what it really has).

    When the upstream closes (the master killed), whatever the proxy still holds is dropped
    and the replica's connection closed: writes the master made in its last `delay_s` never
    reach the replica unless something waited for them. `dropped` counts those bytes.

    Threads of this process only (one to accept, three per connection); `close` stops them."""

    CHUNK = 65536

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = 0
        self.forwarded = 0  # bytes passed on to the replica
        self.dropped = 0  # bytes held when the upstream closed, never passed on
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []

    def start(self) -> DelayingProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((harness.LOOPBACK, 0))
        listener.listen(8)
        self._listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept, name=f"delay-proxy-{self.port}",
                         daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        if self._listener is not None:
            sockets.append(self._listener)
        for sock in sockets:
            self._shut(sock)

    def __enter__(self) -> DelayingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((harness.LOOPBACK, self.upstream_port),
                                                    timeout=1.0)
            except OSError:  # the master is down: the replica tries again later
                self._shut(downstream)
                continue
            upstream.settimeout(None)
            for sock in (downstream, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [downstream, upstream]
            held: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
            for target, args in ((self._pass, (downstream, upstream)),
                                 (self._hold, (upstream, held, downstream)),
                                 (self._release, (held, downstream, upstream))):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _pass(self, source: socket.socket, sink: socket.socket) -> None:
        """replica -> master, at once."""
        try:
            while data := source.recv(self.CHUNK):
                sink.sendall(data)
        except OSError:
            pass
        self._shut(sink)
        self._shut(source)

    def _hold(self, source: socket.socket, held: queue.Queue[tuple[float, bytes] | None],
              replica: socket.socket) -> None:
        """master -> the queue, each piece stamped with when it may go on."""
        try:
            while data := source.recv(self.CHUNK):
                held.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        held.put(None)
        self._shut(replica)  # the master is gone: what is still held is lost with it

    def _release(self, held: queue.Queue[tuple[float, bytes] | None], sink: socket.socket,
                 master: socket.socket) -> None:
        """the queue -> the replica, each piece once its time has come."""
        broken = False
        while (item := held.get()) is not None:
            due, data = item
            if not broken:
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    sink.sendall(data)
                except OSError:
                    broken = True
                else:
                    with self._lock:
                        self.forwarded += len(data)
                    continue
            with self._lock:
                self.dropped += len(data)
        self._shut(master)


class SentinelCluster:
    """A master, one replica (`--replicaof`) and three sentinels (quorum 2) monitoring them as
    `MASTER_NAME`; `down_after_ms` and `failover_timeout_ms` short, so a killed master is
    replaced within seconds. `url` is the `redis+sentinel://` URL Cortex is given.

    `replica_delay_s` > 0: the replica replicates through a `DelayingProxy` (`proxy`), so it
    lags that much behind the master. The sentinels see the replica following the proxy's
    port, not the master's, and "fix" it (point it at the master itself, `+fix-slave-config`)
    once the replica has been up for `failover_timeout_ms`: give a long one (minutes) so the
    lag lasts the test."""

    def __init__(self, directory: Path, *, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 5000, replica_delay_s: float = 0.0) -> None:
        self.directory = directory
        self.replica_delay_s = replica_delay_s
        self.proxy: DelayingProxy | None = None
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.nodes: list[harness.RedisServer] = []
        self.sentinels: list[harness.Process] = []
        self.sentinel_ports: list[int] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{harness.LOOPBACK}:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/0"

    def node(self, port: int) -> harness.RedisServer:
        return next(n for n in self.nodes if n.port == port)

    # -- start and stop -----------------------------------------------------------------
    def start(self) -> SentinelCluster:
        """Master, replica (in sync), then the sentinels, ready once each knows the replica and
        the two other sentinels (a failover needs both)."""
        master = self._server("master").start()
        upstream = master.port
        if self.replica_delay_s > 0:
            self.proxy = DelayingProxy(master.port, self.replica_delay_s).start()
            upstream = self.proxy.port
        replica = self._server("replica", "--replicaof", harness.LOOPBACK, str(upstream))
        replica.start()
        harness.wait_until(lambda: in_sync(replica.port), timeout=30,
                           message="the replica did not sync with the master")
        for n in range(SENTINELS):
            self._start_sentinel(n, master.port)
        harness.wait_until(self._sentinels_ready, timeout=60, interval=0.2,
                           message=lambda: f"sentinels not ready: {self._sentinel_views()}")
        return self

    def close(self) -> None:
        """Stop every process (sentinels first, so none fails over while the nodes stop)."""
        harness.stop_all(processes=self.sentinels)
        for node in self.nodes:
            node.close()
        if self.proxy is not None:
            self.proxy.close()

    def __enter__(self) -> SentinelCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _server(self, name: str, *extra: str) -> harness.RedisServer:
        server = harness.RedisServer(log_dir=self.directory, data_dir=self.directory / name,
                                     extra_args=extra)
        self.nodes.append(server)
        return server

    def _start_sentinel(self, n: int, master_port: int) -> None:
        folder = self.directory / f"sentinel{n}"
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a port taken between the look and the bind: another one
            port = harness.free_port()
            config = folder / "sentinel.conf"  # sentinel rewrites it: a file of its own
            config.write_text("\n".join([
                f"port {port}", f"bind {harness.LOOPBACK}", "daemonize no", 'logfile ""',
                f"dir {folder}",
                f"sentinel monitor {MASTER_NAME} {harness.LOOPBACK} {master_port} {QUORUM}",
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}",
                f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {MASTER_NAME} 1", ""]))
            proc = harness.Process([harness.redis_server_executable(), str(config), "--sentinel"],
                                   name=f"sentinel-{port}", cwd=folder, log_dir=self.directory)
            try:
                harness.wait_until(lambda p=proc, q=port: self._answers(p, q), timeout=10)
            except harness.HarnessError:
                proc.stop()
                continue
            self.sentinels.append(proc)
            self.sentinel_ports.append(port)
            return
        raise harness.HarnessError(f"sentinel {n} did not start:\n{proc.describe(40)}")

    @staticmethod
    def _answers(proc: harness.Process, port: int) -> bool:
        if not proc.alive:
            raise harness.HarnessError(f"{proc.name} exited with {proc.returncode}")
        return role(port) == "sentinel"


    def _sentinel_views(self) -> list[dict[str, Any]]:
        views = []
        for port in self.sentinel_ports:
            client = _client(port)
            try:
                views.append(client.sentinel_master(MASTER_NAME))
            except redis.RedisError as exc:
                views.append({"error": str(exc)})
            finally:
                client.close()
        return views

    def _sentinels_ready(self) -> bool:
        views = self._sentinel_views()
        return len(views) == SENTINELS and all(
            int(v.get("num-other-sentinels", 0)) == SENTINELS - 1 and int(v.get("num-slaves", 0)) >= 1
            for v in views)

    # -- faults -------------------------------------------------------------------------
    def master_port(self) -> int | None:
        """The master's port as a majority of the sentinels name it (None: no majority)."""
        ports = [int(v["port"]) for v in self._sentinel_views() if "port" in v]
        best = max(set(ports), key=ports.count, default=None)
        return best if best is not None and ports.count(best) >= QUORUM else None

    def kill_master(self) -> int:
        """SIGKILL the master (a crash); its port."""
        port = self.master_port()
        assert port is not None, self._sentinel_views()
        self.node(port).kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 60.0) -> int:
        """Wait until the sentinels name another master and it takes writes; its port."""
        def promoted() -> int | None:
            port = self.master_port()
            return port if port not in (None, old_port) and role(port) == "master" else None

        return harness.wait_until(promoted, timeout=timeout, interval=0.1,
                                  message=lambda: f"no failover: {self._sentinel_views()}")

    def restart_as_replica(self, old_port: int, timeout: float = 60.0) -> harness.RedisServer:
        """Start the killed master again on its port (empty: memory only) and wait until the
        sentinels have made it a replica of the new master, in sync."""
        node = self.node(old_port).start()
        harness.wait_until(lambda: role(old_port) == "slave" and in_sync(old_port),
                           timeout=timeout, interval=0.1,
                           message=lambda: f"{old_port} is not a replica: {role(old_port)}")
        return node

