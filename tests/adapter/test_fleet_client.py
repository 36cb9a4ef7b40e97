"""The router's ADS client against a real in-process control-plane xDS server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import structlog.testing
from prometheus_client import REGISTRY

from extproc.adapter.fleet_client import FleetClient
from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.control.snapshot import (
    FleetSnapshot,
    LoadSnapshot,
    PublishedHost,
    SnapshotStore,
    content_version,
)
from extproc.control.xds_server import XdsServer
from extproc.stack.processes import free_port

CP_HOST = "127.0.0.1"
CLUSTER = "vllm"
A = "127.0.0.24:8000"
B = "127.0.0.25:8000"
C = "127.0.0.26:8000"
D = "127.0.0.27:8000"
PATIENCE_S = 10.0


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def nacks() -> float:
    return metric("prefix_router_cp_xds_nacks_total")


def fleet(*hosts: PublishedHost) -> FleetSnapshot:
    return FleetSnapshot.build(CLUSTER, hosts)


class UncheckedFleet(FleetSnapshot):
    """A fleet snapshot that skips validation, to make the server send a bad CLA."""

    def check(self) -> None:
        return None


def duplicate_fleet(address: str) -> UncheckedFleet:
    hosts = (PublishedHost(address), PublishedHost(address, draining=True))
    return UncheckedFleet(CLUSTER, hosts, content_version(["bad", address]))


@contextlib.asynccontextmanager
async def xds_server(store: SnapshotStore, port: int) -> AsyncIterator[None]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        XdsServer(store, frozenset({CLUSTER, CLUSTER + "/load"})).handlers()
    )
    assert server.add_insecure_port(f"{CP_HOST}:{port}") == port
    await server.start()
    try:
        yield
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def fleet_client(router: Router, target: str) -> AsyncIterator[FleetClient]:
    client = FleetClient(router, target, CLUSTER)
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    try:
        yield client
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)


async def eventually(condition: Callable[[], bool], timeout: float = PATIENCE_S) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def make_router(port: int) -> Router:
    return Router(RouterConfig(control_plane=f"{CP_HOST}:{port}", cluster=CLUSTER))


def addresses(router: Router) -> set[str]:
    return set(router.hosts.addresses)


def models(router: Router) -> dict[str, frozenset[str]]:
    return {h.address: h.models for h in router.hosts.hosts}


@pytest.fixture
def port() -> int:
    return free_port(CP_HOST)


async def test_client_gets_the_fleet_minus_draining_hosts(port: int) -> None:
    store = SnapshotStore()
    store.publish(
        fleet(
            PublishedHost(A, models=("base", "lora-a")),
            PublishedHost(B, models=("base",)),
            PublishedHost(C, draining=True, models=("base",)),
        )
    )
    router = make_router(port)
    assert not router.ready.is_set()
    async with xds_server(store, port), fleet_client(router, f"{CP_HOST}:{port}"):
        await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
        assert addresses(router) == {A, B}
        assert models(router) == {A: frozenset({"base", "lora-a"}), B: frozenset({"base"})}
        # An update replaces the set.
        store.publish(fleet(PublishedHost(B), PublishedHost(D)))
        await eventually(lambda: addresses(router) == {B, D})
        # Every host ejected: the router's set empties too.
        store.publish(fleet())
        await eventually(lambda: len(router.hosts) == 0)
        # Every host draining: none is left for placement.
        store.publish(fleet(PublishedHost(A, draining=True)))
        store.publish(fleet(PublishedHost(A), PublishedHost(B, draining=True)))
        await eventually(lambda: addresses(router) == {A})


async def test_client_receives_the_load_feed(port: int) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A), PublishedHost(B)))
    router = make_router(port)
    async with xds_server(store, port), fleet_client(router, f"{CP_HOST}:{port}"):
        await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
        assert router.feed_age() == float("inf")
        store.publish(
            LoadSnapshot.build(CLUSTER, {A: HostLoad(running=3, waiting=2, scraped_at=7.0)})
        )
        await eventually(lambda: router.feed_age() < PATIENCE_S)
        assert router.feed_age() < 2.0
        loads = router._loads(router.config.routing_strategy)
        assert loads[A] == 5
        assert loads[B] == 0


async def test_client_keeps_the_last_set_and_reconnects(port: int) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A), PublishedHost(B)))
    router = make_router(port)
    target = f"{CP_HOST}:{port}"
    async with fleet_client(router, target):
        async with xds_server(store, port):
            await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
            assert addresses(router) == {A, B}
        # The control plane is gone: the router keeps placing over the last set.
        await asyncio.sleep(0.5)
        assert addresses(router) == {A, B}
        assert router.ready.is_set()
        restarted = SnapshotStore()
        restarted.publish(fleet(PublishedHost(C), PublishedHost(D)))
        async with xds_server(restarted, port):
            await eventually(lambda: addresses(router) == {C, D})


async def test_the_backoff_starts_over_after_a_session_that_received_the_fleet(
    port: int,
) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A)))
    router = make_router(port)
    with structlog.testing.capture_logs() as logs:

        def attempts() -> list[int]:
            return [e["attempt"] for e in logs if e["event"] == "control_plane_unreachable"]

        async with fleet_client(router, f"{CP_HOST}:{port}") as client:
            # No control plane yet: each attempt waits longer than the one before.
            await eventually(lambda: client.attempt >= 5)
            async with xds_server(store, port):
                await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
                healthy = client.attempt  # the attempt whose session got the fleet
            # That session ends with the server: then two more failed attempts.
            await eventually(
                lambda: attempts().count(healthy) == 1 and len(attempts()) >= healthy + 2
            )
    seen = attempts()
    # The session ended after it had received the fleet: the next outage is retried from
    # the first, shortest delay, not the long one the earlier outage had reached.
    assert seen[: healthy + 2] == [*range(1, healthy + 1), 1, 2], seen


async def test_client_starts_before_the_control_plane(port: int) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A)))
    router = make_router(port)
    async with fleet_client(router, f"{CP_HOST}:{port}"):
        await asyncio.sleep(0.3)
        assert not router.ready.is_set()
        async with xds_server(store, port):
            await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
            assert addresses(router) == {A}


async def test_invalid_cla_is_nacked_and_the_previous_set_kept(port: int) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A), PublishedHost(B)))
    router = make_router(port)
    async with xds_server(store, port), fleet_client(router, f"{CP_HOST}:{port}"):
        await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
        before = nacks()
        assert store.publish(duplicate_fleet(C))
        await eventually(lambda: nacks() > before)
        assert nacks() == before + 1
        assert addresses(router) == {A, B}
        # The next valid fleet is accepted.
        store.publish(fleet(PublishedHost(D)))
        await eventually(lambda: addresses(router) == {D})
        assert nacks() == before + 1


async def test_stop_ends_the_client_promptly(port: int) -> None:
    router = make_router(port)
    client = FleetClient(router, f"{CP_HOST}:{port}", CLUSTER)
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    await asyncio.sleep(0.2)  # retrying against nothing
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert task.exception() is None
    assert len(router.hosts) == 0
    assert not router.ready.is_set()
