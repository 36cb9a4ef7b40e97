"""``router --workers N``: the supervisor and its worker processes, as real processes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from extproc import ports, tls
from extproc.adapter.messages import TARGET_HEADER, ProcessingResponse
from extproc.adapter.service import SERVICE_NAME, server_options
from extproc.adapter.workers import exchange_endpoints, worker_address, worker_overrides
from extproc.bench.probes import scrape, total
from extproc.config import RouterConfig
from extproc.errors import ConfigError
from extproc.stack.processes import free_port, free_port_run, port_is_free, wait_until

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.21:8000", "127.0.0.22:8000")


def test_worker_i_listens_on_the_ports_plus_i_and_runs_alone():
    config = RouterConfig(hosts=HOSTS, workers=3, listen="127.0.0.1:6000")
    overrides = worker_overrides(config, {"prefix_length": 2048}, 2)
    assert overrides == {
        "prefix_length": 2048,
        "listen": "127.0.0.1:6002",
        "metrics_listen": ports.loopback(ports.ROUTER_METRICS + 2),
        "workers": 1,
    }
    assert worker_address("[::1]:7000", 1) == "[::1]:7001"
    # A Unix socket: worker 0 keeps the path, worker i appends .i.
    assert worker_address("unix:/run/r.sock", 0) == "unix:/run/r.sock"
    assert worker_address("unix:/run/r.sock", 2) == "unix:/run/r.sock.2"


def test_workers_that_share_listen_all_take_it_and_move_only_their_metrics():
    # ``epp --workers N``: a gateway knows one address, so listen and health_listen stay.
    config = RouterConfig(
        hosts=HOSTS,
        workers=3,
        workers_share_listen=True,
        listen="0.0.0.0:9002",
        health_listen="0.0.0.0:9003",
        metrics_listen="0.0.0.0:9090",
    )
    overrides = {"health_listen": "0.0.0.0:9003", "workers_share_listen": True}
    for index in range(3):
        assert worker_overrides(config, overrides, index) == {
            **overrides,
            "listen": "0.0.0.0:9002",
            "metrics_listen": f"0.0.0.0:{9090 + index}",
            "workers": 1,
        }
    # Own ports (the router's), health_listen is still one address all of them bind.
    own = RouterConfig(hosts=HOSTS, workers=2, health_listen="127.0.0.1:7000")
    assert "health_listen" not in worker_overrides(own, {}, 1)


def test_a_shared_listen_may_sit_at_the_top_port_its_metrics_may_not():
    top = RouterConfig(listen="127.0.0.1:65535", workers=64, workers_share_listen=True)
    assert top.workers == 64
    with pytest.raises(ConfigError, match="metrics_listen on port 65500"):
        RouterConfig(
            listen="127.0.0.1:9002",
            metrics_listen="127.0.0.1:65500",
            workers=64,
            workers_share_listen=True,
        )
    with pytest.raises(ConfigError, match="Unix socket"):
        RouterConfig(listen="unix:/run/r.sock", workers_share_listen=True)


@pytest.mark.parametrize(
    ("settings", "field", "port"),
    [
        # The picker's ports with the router's scheme: worker 1's gRPC would be 9003.
        ({"workers": 2, "health_listen": "0.0.0.0:9003"}, "health_listen", 9003),
        # Shared: the ext_proc and the health server would split one port's connections.
        ({"workers_share_listen": True, "health_listen": "127.0.0.1:9002"}, "health_listen", 9002),
        ({"workers": 3, "metrics_listen": "0.0.0.0:9004"}, "metrics_listen", 9004),
    ],
)
def test_addresses_whose_worker_ports_meet_are_refused(settings, field, port):
    with pytest.raises(ConfigError, match=f"would take port {port}") as error:
        RouterConfig(**{"listen": "127.0.0.1:9002", **settings})
    assert error.value.field == field


def test_addresses_on_different_ips_may_share_a_port_number():
    config = RouterConfig(listen="127.0.0.1:9002", metrics_listen="127.0.0.2:9002", workers=2)
    assert config.workers == 2


async def test_a_port_of_its_own_refuses_a_second_server_a_shared_one_takes_both():
    # gRPC sets SO_REUSEPORT unless told not to: a second router on a router's port
    # would have split its connections without an error.
    for shared in (False, True):
        address = f"127.0.0.1:{free_port()}"
        first = grpc.aio.server(options=server_options(shared))
        second = grpc.aio.server(options=server_options(shared))
        try:
            tls.listen(first, address, None)
            if shared:
                tls.listen(second, address, None)
            else:
                with pytest.raises(OSError, match="cannot listen"):
                    tls.listen(second, address, None)
        finally:
            await first.stop(0)
            await second.stop(0)


def metrics_up(port: int) -> bool:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
    except httpx.HTTPError:
        return False
    return "prefix_router_hosts 2.0" in text


def started(log: Path) -> int:
    """How many workers have logged that they listen."""
    return log.read_text().count('"event": "router_started"')


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True)
    return [
        int(line.split()[0])
        for line in out.stdout.decode().splitlines()
        if "spawn_main" in line  # not multiprocessing's resource tracker
    ]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True)
    return not out.stdout.decode().startswith("Z")


def start_supervisor(
    tmp_path: Path, workers: int, base: int, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "extproc", "router", "--workers", str(workers),
        "--listen", f"127.0.0.1:{base}", "--metrics-listen", f"127.0.0.1:{base + workers}",
        *(arg for host in HOSTS for arg in ("--host", host)),
    ]  # fmt: skip
    with (tmp_path / "router.log").open("wb") as log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )


@pytest.mark.timeout(120)
def test_workers_serve_apart_a_dead_one_comes_back_and_sigterm_drains_them_all(tmp_path):
    base = free_port_run(4)
    supervisor = start_supervisor(tmp_path, 2, base)
    log_path = tmp_path / "router.log"
    try:
        # A worker has started once it logs router_started, after its ports are bound: its
        # metrics answer before that, and a worker killed before it listens the first time
        # is one that could not start (it stops them all).
        wait_until(lambda: started(log_path) == 2, 30, "both workers listening")
        for port in (base + 2, base + 3):
            assert metrics_up(port)
        workers = children(supervisor.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        wait_until(
            lambda: (
                len(children(supervisor.pid)) == 2
                and not alive(workers[1])
                and started(log_path) == 3
            ),
            30,
            "a restart",
        )
        wait_until(lambda: metrics_up(base + 3), 30, "the restarted worker")
        assert metrics_up(base + 2)  # the other worker was never touched
        replaced = children(supervisor.pid)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in replaced)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    log = log_path.read_text()
    assert '"event": "router_worker_exited"' in log and '"exitcode": -9' in log
    assert log.count('"event": "router_stopped"') == 2  # each worker drained


@pytest.mark.timeout(120)
def test_workers_stop_when_their_supervisor_is_killed(tmp_path):
    base = free_port_run(4)
    supervisor = start_supervisor(tmp_path, 2, base)
    try:
        wait_until(lambda: metrics_up(base + 2) and metrics_up(base + 3), 30, "both workers")
        workers = children(supervisor.pid)
        supervisor.kill()
        supervisor.wait()
        wait_until(
            lambda: not any(alive(pid) for pid in workers),
            30,
            "the orphaned workers to stop",
            interval_s=0.2,
        )
        assert not any(alive(pid) for pid in workers)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_start_stops_them_all_with_an_error(tmp_path):
    base = free_port_run(4)
    blocker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # Holds the port for longer than the test runs.
            f"import socket,time; s=socket.socket(); "
            f"s.bind(('127.0.0.1',{base + 3})); s.listen(); time.sleep(60)",
        ]
    )
    try:
        wait_until(
            lambda: not port_is_free("127.0.0.1", base + 3), 10, "the blocker to hold its port"
        )
        supervisor = start_supervisor(tmp_path, 2, base)
        assert supervisor.wait(timeout=40) == 1
    finally:
        blocker.kill()
        blocker.wait()
    log = (tmp_path / "router.log").read_text()
    assert '"event": "router_worker_failed_to_start"' in log and '"worker": 1' in log


@pytest.mark.timeout(60)
def test_every_worker_runs_on_the_configured_event_loop(tmp_path):
    base = free_port_run(4)
    supervisor = start_supervisor(tmp_path, 2, base, env={"PREFIX_ROUTER_EVENT_LOOP": "asyncio"})
    try:
        wait_until(lambda: metrics_up(base + 2) and metrics_up(base + 3), 30, "both workers")
    finally:
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
    log = (tmp_path / "router.log").read_text()
    assert log.count('"event_loop": "asyncio"') == 2


def test_workers_that_share_decisions_bind_their_own_endpoint_and_subscribe_to_the_others():
    config = RouterConfig(hosts=HOSTS, workers=3, listen="127.0.0.1:6000")
    endpoints = exchange_endpoints(Path("/run/r"), 3)
    assert endpoints == [f"ipc:///run/r/decisions-{i}" for i in range(3)]
    overrides = worker_overrides(config, {}, 1, endpoints)
    assert overrides["decision_exchange_bind"] == endpoints[1]
    assert overrides["decision_exchange_peers"] == [endpoints[0], endpoints[2]]
    # What the supervisor passes makes a valid worker config.
    worker = config.replace(**overrides)
    assert worker.decision_exchange_peers == (endpoints[0], endpoints[2])
    # A supervisor's own config leaves them to it.
    with pytest.raises(ConfigError, match="the supervisor gives each worker its siblings"):
        config.replace(decision_exchange_peers=[endpoints[0]])


def routed_to(address: str, body: bytes) -> str:
    """One buffered ext_proc request: the host the router answers with."""
    with grpc.insecure_channel(address) as channel:
        process = channel.stream_stream(
            f"/{SERVICE_NAME}/Process",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=ProcessingResponse.FromString,
        )
        post = {":method": "POST", "content-type": "application/json"}
        call = process(iter([request_headers(post), request_body(body)]), timeout=10)
        try:
            for response in call:
                for option in response.request_body.response.header_mutation.set_headers:
                    if option.header.key == TARGET_HEADER:
                        return option.header.raw_value.decode()
        finally:
            call.cancel()
    raise AssertionError("no decision")


def worker_counts(port: int) -> tuple[float, float]:
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    return (
        total(samples, "prefix_router_decisions_published_total"),
        total(samples, "prefix_router_sibling_decisions_applied_total"),
    )


def exchange_connected(workers: tuple[str, str], metrics: tuple[int, int]) -> None:
    """Until each worker has applied one of the other's decisions: a ZMQ publisher drops
    what it sends before its sibling's subscription has joined (that retries with a
    backoff), so a fixed pause is not enough on a busy machine. Warm-up documents of their
    own, one to each worker per try."""
    tries = itertools.count()

    def applied_both_ways() -> bool:
        n = next(tries)
        for worker in workers:
            routed_to(worker, new_document(10_000 + n))
        return all(worker_counts(port)[1] > 0 for port in metrics)

    wait_until(applied_both_ways, 30, "each worker to apply one of the other's decisions")
    # The last try's decisions may still be on their way (batched every 2 ms): the counts
    # the test starts from are those that stopped changing.
    last: list[object] = [None]

    def settled() -> bool:
        counts = [worker_counts(port) for port in metrics]
        unchanged, last[0] = counts == last[0], counts
        return unchanged

    wait_until(settled, 10, "the warm-up decisions to arrive", interval_s=0.2)


def new_document(n: int) -> bytes:
    text = f"document {n} " + "the body of this document goes on " * 60
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("share", [True, False])
def test_two_workers_send_one_new_prompts_requests_to_one_host(tmp_path, share):
    base = free_port_run(4)
    env = {"PREFIX_ROUTER_KV_EVENTS": "false"}
    if not share:
        env["PREFIX_ROUTER_WORKERS_SHARE_DECISIONS"] = "false"
    supervisor = start_supervisor(tmp_path, 2, base, env=env)
    workers = (f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}")
    metrics = (base + 2, base + 3)
    try:
        wait_until(lambda: all(metrics_up(port) for port in metrics), 30, "both workers")
        if share:
            exchange_connected(workers, metrics)
        before = [worker_counts(port) for port in metrics]
        for n in range(8):
            placed = set()
            for turn in range(4):  # worker 0, worker 1, worker 0, worker 1
                placed.add(routed_to(workers[turn % 2], new_document(n)))
                if share:  # the other worker applies this decision before it routes
                    other = (turn + 1) % 2
                    sent = before[other][1] + 2 * n + turn // 2 + 1
                    wait_until(
                        lambda o=metrics[other], s=sent: worker_counts(o)[1] >= s,
                        5,
                        f"the decision of request {4 * n + turn} applied",
                    )
            if share:
                assert len(placed) == 1, (n, placed)
        after = [worker_counts(port) for port in metrics]
        counts = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    finally:
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
    if share:
        # Each worker published its 16 decisions and applied the other's.
        assert counts == [(16.0, 16.0), (16.0, 16.0)], counts
    else:
        assert counts == [(0.0, 0.0), (0.0, 0.0)], counts
