"""xDS edge cases against the real Envoy: NACKs, and a router that starts first."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from extproc.control.snapshot import (
    FleetSnapshot,
    PublishedHost,
    SnapshotStore,
    content_version,
)
from extproc.control.xds_server import XdsServer
from extproc.stack.local import LocalStack, ManagedProcess, envoy_counters
from extproc.stack.processes import wait_until, wait_until_async

from .fleet_helpers import fleet_spec, placements


def nacks() -> float:
    return REGISTRY.get_sample_value("prefix_router_cp_xds_nacks_total") or 0.0


def unchecked_fleet(name: str, addresses: list[str]) -> FleetSnapshot:
    """A snapshot that skips FleetSnapshot.build's validation, as a buggy source might."""
    hosts = tuple(PublishedHost(a) for a in addresses)
    return FleetSnapshot(name, hosts, content_version([name, [asdict(h) for h in hosts]]))


async def test_envoy_nack_is_counted_and_the_fleet_keeps_serving(tmp_path):
    spec = fleet_spec(3, work_dir=tmp_path)
    stack = LocalStack(spec)
    store = SnapshotStore()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(XdsServer(store, frozenset({"vllm"})).handlers())
    host, port = spec.control_plane
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    try:
        await asyncio.to_thread(stack.start_sims)
        store.publish(
            FleetSnapshot.build("vllm", [PublishedHost(a) for a in stack.backend_addresses])
        )
        await asyncio.to_thread(stack.start_router)
        await asyncio.to_thread(stack.start_envoy)
        before = await asyncio.to_thread(placements, stack, range(30))
        nacks_before = nacks()

        # Port 70000 passes our store's consistency check but not Envoy's validation.
        store.publish(unchecked_fleet("vllm", [*stack.backend_addresses, "127.0.0.14:70000"]))
        await wait_until_async(  # Envoy and the router both reject it
            lambda: nacks() >= nacks_before + 2, 5, what="Envoy's and the router's NACKs"
        )
        assert nacks() >= nacks_before + 2
        assert envoy_counters(stack.admin_url, "cluster.vllm.")["update_rejected"] >= 1
        # Both kept the last good fleet and keep serving it.
        after = await asyncio.to_thread(placements, stack, range(30))
        assert after == before
        assert await asyncio.to_thread(stack.envoy_hosts) == set(stack.backend_addresses)

        # The rejected version is not resent; the next good one goes out.
        smaller = stack.backend_addresses[:2]
        store.publish(FleetSnapshot.build("vllm", [PublishedHost(a) for a in smaller]))
        await asyncio.to_thread(
            wait_until, lambda: stack.envoy_hosts() == set(smaller), 10, "the next good fleet"
        )
    finally:
        await asyncio.to_thread(stack.stop)
        await server.stop(0)


def router_health(stack: LocalStack) -> int:
    host, port = stack.spec.router
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        except grpc.RpcError:
            return -1  # not listening yet


def test_router_started_before_the_control_plane_waits_then_serves(tmp_path):
    stack = LocalStack(fleet_spec(3, work_dir=tmp_path))
    try:
        stack.start_sims()
        stack.write_router_config()
        stack.router = ManagedProcess(
            "router",
            stack._python("router", "--config", str(stack.router_config_path())),
            tmp_path / "router.log",
        ).start()
        wait_until(
            lambda: router_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING,
            20,
            "the router to answer health checks",
            stack.router,
        )
        assert stack.router_metric("prefix_router_hosts") == 0
        stack.start_control_plane()
        wait_until(
            lambda: router_health(stack) == health_pb2.HealthCheckResponse.SERVING,
            10,
            "the router to serve",
            stack.router,
        )
        stack.start_envoy()
        assert len(set(placements(stack, range(30)).values())) == 3
    finally:
        with contextlib.suppress(Exception):
            stack.stop()
