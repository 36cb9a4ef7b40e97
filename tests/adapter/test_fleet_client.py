"""The router's ADS client against a real in-process control-plane xDS server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

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
from extproc.stack.processes import free_port, wait_until_async

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


def connected() -> float:
    return metric("prefix_router_control_plane_connected")


def unreachable(logs: list[dict]) -> list[int]:
    """The attempts that ``control_plane_unreachable`` log lines name, in order."""
    return [e["attempt"] for e in logs if e["event"] == "control_plane_unreachable"]


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
        await wait_until_async(lambda: addresses(router) == {B, D}, PATIENCE_S, what="{B, D}")
        # Every host ejected: the router's set empties too.
        store.publish(fleet())
        await wait_until_async(lambda: len(router.hosts) == 0, PATIENCE_S, what="no hosts")
        # Every host draining: none is left for placement.
        store.publish(fleet(PublishedHost(A, draining=True)))
        store.publish(fleet(PublishedHost(A), PublishedHost(B, draining=True)))
        await wait_until_async(lambda: addresses(router) == {A}, PATIENCE_S, what="{A}")


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
        await wait_until_async(lambda: router.feed_age() < PATIENCE_S, PATIENCE_S, what="a feed")
        assert router.feed_age() < 2.0
        loads = router.ledger.loads(router.config.routing_strategy, router.hosts, time.monotonic())
        assert loads[A] == 5
        assert loads[B] == 0


async def test_client_keeps_the_last_set_and_reconnects(port: int) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A), PublishedHost(B)))
    router = make_router(port)
    target = f"{CP_HOST}:{port}"
    with structlog.testing.capture_logs() as logs:
        async with fleet_client(router, target):
            async with xds_server(store, port):
                await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
                assert addresses(router) == {A, B}
                logged = len(logs)
            # The control plane is gone. Once the router has found so (its session ended)
            # and a reconnect has failed, it keeps placing over the last set.
            await wait_until_async(
                lambda: len(unreachable(logs[logged:])) >= 2 and connected() == 0,
                PATIENCE_S,
                what="the session's end and a failed reconnect",
            )
            assert addresses(router) == {A, B}
            assert router.ready.is_set()
            restarted = SnapshotStore()
            restarted.publish(fleet(PublishedHost(C), PublishedHost(D)))
            async with xds_server(restarted, port):
                await wait_until_async(
                    lambda: addresses(router) == {C, D}, PATIENCE_S, what="the new fleet"
                )


async def test_the_backoff_starts_over_after_a_session_that_received_the_fleet(
    port: int,
) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A)))
    router = make_router(port)
    with structlog.testing.capture_logs() as logs:

        def attempts() -> list[int]:
            return unreachable(logs)

        async with fleet_client(router, f"{CP_HOST}:{port}") as client:
            # No control plane yet: each attempt waits longer than the one before.
            await wait_until_async(lambda: client.attempt >= 5, PATIENCE_S, what="5 attempts")
            async with xds_server(store, port):
                await asyncio.wait_for(router.ready.wait(), timeout=PATIENCE_S)
                healthy = client.attempt  # the attempt whose session got the fleet
            # That session ends with the server: then two more failed attempts.
            await wait_until_async(
                lambda: attempts().count(healthy) == 1 and len(attempts()) >= healthy + 2,
                PATIENCE_S,
                what="the session's end and two failed attempts",
            )
    seen = attempts()
    # The session ended after it had received the fleet: the next outage is retried from
    # the first, shortest delay, not the long one the earlier outage had reached.
    assert seen[: healthy + 2] == [*range(1, healthy + 1), 1, 2], seen


async def test_client_starts_before_the_control_plane(port: int) -> None:
    store = SnapshotStore()
    store.publish(fleet(PublishedHost(A)))
    router = make_router(port)
    async with fleet_client(router, f"{CP_HOST}:{port}") as client:
        # Retrying against nothing (an attempt has failed): not ready.
        await wait_until_async(lambda: client.attempt >= 2, PATIENCE_S, what="a failed attempt")
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
        await wait_until_async(lambda: nacks() > before, PATIENCE_S, what="a NACK")
        assert nacks() == before + 1
        assert addresses(router) == {A, B}
        # The next valid fleet is accepted.
        store.publish(fleet(PublishedHost(D)))
        await wait_until_async(lambda: addresses(router) == {D}, PATIENCE_S, what="{D}")
        assert nacks() == before + 1


async def test_stop_ends_the_client_promptly(port: int) -> None:
    router = make_router(port)
    client = FleetClient(router, f"{CP_HOST}:{port}", CLUSTER)
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    # Stopped while it retries against nothing (an attempt has failed).
    await wait_until_async(lambda: client.attempt >= 2, PATIENCE_S, what="a failed attempt")
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert task.exception() is None
    assert len(router.hosts) == 0
    assert not router.ready.is_set()
