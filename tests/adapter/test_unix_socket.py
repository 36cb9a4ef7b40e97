"""``listen: unix:/path``: the router on a Unix socket, as real processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack.processes import free_ports, wait_until

HOSTS = ("127.0.0.21:8000", "127.0.0.22:8000")


def start_router(tmp_path: Path, path: Path, name: str = "router") -> subprocess.Popen[bytes]:
    (metrics,) = free_ports(1)
    command = [
        sys.executable, "-m", "extproc", "router", "--listen", f"unix:{path}",
        "--metrics-listen", f"127.0.0.1:{metrics}",
        *(arg for host in HOSTS for arg in ("--host", host)),
    ]  # fmt: skip
    with (tmp_path / f"{name}.log").open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def serving(path: Path) -> bool:
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)


@pytest.mark.timeout(120)
def test_a_router_on_a_socket_serves_refuses_a_second_and_replaces_a_dead_ones(tmp_path):
    path = tmp_path / "router.sock"
    first = start_router(tmp_path, path, "first")
    try:
        wait_until(lambda: serving(path), 30, "the router to serve on its socket")
        # A second router on the same path must not unlink the live socket and take over.
        second = start_router(tmp_path, path, "second")
        assert second.wait(timeout=30) == 1
        assert "another process is listening on it" in (tmp_path / "second.log").read_text()
        assert serving(path)
        # SIGKILL leaves the socket file behind; the next router replaces it.
        first.kill()
        first.wait(timeout=10)
        assert path.exists()
        first = start_router(tmp_path, path, "third")
        wait_until(lambda: serving(path), 30, "a new router to take the dead one's socket")
    finally:
        assert stop(first) == 0
    # A clean stop removes the socket.
    assert not path.exists()


def test_a_router_refuses_a_path_that_is_not_a_socket(tmp_path):
    path = tmp_path / "router.sock"
    path.write_text("not a socket")
    router = start_router(tmp_path, path)
    assert router.wait(timeout=30) == 1
    assert "exists and is not a socket" in (tmp_path / "router.log").read_text()
    assert path.read_text() == "not a socket"


def test_a_stale_socket_nobody_listens_on_is_free(tmp_path):
    from extproc.adapter.service import check_socket_path_free

    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    check_socket_path_free(str(path))  # nothing listens: no error
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live.sock"))
    live.listen()
    try:
        with pytest.raises(OSError, match="another process is listening"):
            check_socket_path_free(str(tmp_path / "live.sock"))
    finally:
        live.close()
