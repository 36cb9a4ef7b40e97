"""SIGTERM drains: open ext_proc streams get ``drain_timeout_s``, then are cancelled."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from extproc.adapter.service import SERVICE_NAME, serve
from extproc.config import RouterConfig
from extproc.stack.processes import free_ports, wait_until

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.21:8000", "127.0.0.22:8000")
DRAIN_S = 3.0


def open_stream(address: str, answered: threading.Event, ended: queue.Queue[str]) -> None:
    """One ext_proc stream that sends a request and then stays open, as Envoy keeps a
    BUFFERED_PARTIAL stream open while the LLM response streams."""
    release = threading.Event()

    def messages():  # type: ignore[no-untyped-def]
        yield request_headers({":method": "POST", "content-type": "application/json"})
        yield request_body(b'{"model":"m","prompt":"hello"}')
        release.wait(60)

    with grpc.insecure_channel(address) as channel:
        process = channel.stream_stream(
            f"/{SERVICE_NAME}/Process",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        try:
            for count, _ in enumerate(process(messages(), timeout=60), start=1):
                if count == 2:  # headers and body answered: the request is routed
                    answered.set()
            ended.put("closed")
        except grpc.RpcError as error:
            ended.put(error.code().name)
        finally:
            release.set()


@pytest.mark.timeout(60)
def test_sigterm_gives_open_streams_the_drain_timeout_then_cancels_them(tmp_path: Path):
    grpc_port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    command = [
        sys.executable, "-m", "extproc", "router", "--listen", address,
        "--metrics-listen", f"127.0.0.1:{metrics_port}",
        *(arg for host in HOSTS for arg in ("--host", host)),
    ]  # fmt: skip
    env = {**os.environ, "PREFIX_ROUTER_DRAIN_TIMEOUT_S": str(DRAIN_S)}
    with (tmp_path / "router.log").open("wb") as log:
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        answered, ended = threading.Event(), queue.Queue[str]()
        wait_until(lambda: "router_serving" in (tmp_path / "router.log").read_text(), 30, "ready")
        client = threading.Thread(target=open_stream, args=(address, answered, ended))
        client.start()
        assert answered.wait(10), "the router never answered the stream"
        started = time.monotonic()
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=DRAIN_S + 20) == 0
        took = time.monotonic() - started
        client.join(10)
    finally:
        if router.poll() is None:
            router.kill()
    # The open stream kept the router for its drain timeout, then was cancelled.
    assert DRAIN_S - 0.5 <= took <= DRAIN_S + 5, took
    assert ended.get(timeout=1) in ("CANCELLED", "UNAVAILABLE")


async def test_a_sigterm_while_it_starts_ends_in_a_drain_not_in_death():
    # A supervisor stopping its workers, or a pod deleted, may signal a router that has not
    # finished starting: serve() takes SIGTERM from its first line, so it still drains and
    # returns. A handler of the test's own sees the signal only if serve() had not taken it.
    grpc_port, metrics_port = free_ports(2)
    config = RouterConfig(
        hosts=("127.0.0.1:8000",),
        listen=f"127.0.0.1:{grpc_port}",
        metrics_listen=f"127.0.0.1:{metrics_port}",
        drain_timeout_s=1,
    )
    missed: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: missed.append(signum))
    try:
        serving = asyncio.ensure_future(serve(config))
        # Runs at serve()'s first await, while its servers start.
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert missed == []
