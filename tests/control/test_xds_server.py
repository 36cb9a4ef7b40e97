import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from prometheus_client import REGISTRY

from extproc.control.model import HostLoad
from extproc.control.resources import CLA_TYPE_URL, cla_to_fleet, cla_to_loads
from extproc.control.snapshot import FleetSnapshot, LoadSnapshot, PublishedHost, SnapshotStore
from extproc.control.xds_protocol import DiscoveryRequest, DiscoveryResponse
from extproc.control.xds_server import XdsServer
from extproc.stack.processes import wait_until_async

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
EDS = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
A = "127.0.0.1:8001"
B = "127.0.0.2:8002"
C = "127.0.0.3:8003"
FLEET = "vllm"
LOAD = "vllm/load"
SILENCE_S = 0.3
PATIENCE_S = 5.0


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def fleet(*addresses: str) -> FleetSnapshot:
    return FleetSnapshot.build(FLEET, [PublishedHost(a) for a in addresses])


def decode(response: DiscoveryResponse) -> dict[str, endpoint_pb2.ClusterLoadAssignment]:
    found = {}
    for resource in response.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert resource.Unpack(cla)
        found[cla.cluster_name] = cla
    return found


def hosts_of(response: DiscoveryResponse) -> list[str]:
    return [h.address for h in cla_to_fleet(decode(response)[FLEET]).hosts]


@dataclass
class ControlPlane:
    store: SnapshotStore
    target: str


@pytest.fixture
async def control_plane() -> AsyncIterator[ControlPlane]:
    store = SnapshotStore()
    store.publish(fleet(A, B))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(XdsServer(store, frozenset({FLEET})).handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        yield ControlPlane(store, f"127.0.0.1:{port}")
    finally:
        await server.stop(0)


class Client:
    """A raw xDS client: writes requests, queues every response it reads."""

    def __init__(self, target: str, method: str) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._call = self._channel.stream_stream(
            method,
            request_serializer=DiscoveryRequest.SerializeToString,
            response_deserializer=DiscoveryResponse.FromString,
        )()
        self.responses: asyncio.Queue[DiscoveryResponse] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            response = await self._call.read()
            if response is grpc.aio.EOF:
                return
            await self.responses.put(response)

    async def send(
        self,
        names: Sequence[str] = (FLEET,),
        version: str = "",
        nonce: str = "",
        error: str | None = None,
    ) -> None:
        request = DiscoveryRequest(
            version_info=version, response_nonce=nonce, type_url=CLA_TYPE_URL, resource_names=names
        )
        request.node.id = "test-client"
        if error is not None:
            request.error_detail.code = 3
            request.error_detail.message = error
        await self._call.write(request)

    async def receive(self) -> DiscoveryResponse:
        return await asyncio.wait_for(self.responses.get(), timeout=PATIENCE_S)

    async def silent(self) -> bool:
        try:
            await asyncio.wait_for(self.responses.get(), timeout=SILENCE_S)
        except TimeoutError:
            return True
        return False

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._reader
        await self._channel.close()


@contextlib.asynccontextmanager
async def client(target: str, method: str = ADS) -> AsyncIterator[Client]:
    opened = Client(target, method)
    try:
        yield opened
    finally:
        await opened.close()


async def test_ads_sends_the_cla_ack_is_silent_and_publish_pushes(
    control_plane: ControlPlane,
) -> None:
    async with client(control_plane.target) as xds:
        await xds.send()
        first = await xds.receive()
        assert first.type_url == CLA_TYPE_URL
        assert first.version_info
        assert hosts_of(first) == [A, B]
        await xds.send(version=first.version_info, nonce=first.nonce)
        assert await xds.silent()
        # A no-op publish pushes nothing.
        assert control_plane.store.publish(fleet(B, A)) is False
        assert await xds.silent()
        control_plane.store.publish(fleet(A, B, C))
        update = await xds.receive()
        assert hosts_of(update) == [A, B, C]
        assert int(update.nonce) > int(first.nonce)
        assert update.version_info != first.version_info
        await xds.send(version=update.version_info, nonce=update.nonce)
        assert await xds.silent()


async def test_ads_carries_the_load_resource(control_plane: ControlPlane) -> None:
    control_plane.store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=2, waiting=1)}))
    async with client(control_plane.target) as xds:
        await xds.send([FLEET, LOAD])
        response = await xds.receive()
        clas = decode(response)
        assert set(clas) == {FLEET, LOAD}
        assert cla_to_loads(clas[LOAD])[A].outstanding == 3
        await xds.send([FLEET, LOAD], response.version_info, response.nonce)
        control_plane.store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=5)}))
        update = await xds.receive()
        assert set(decode(update)) == {LOAD}


async def test_plain_eds_works(control_plane: ControlPlane) -> None:
    async with client(control_plane.target, EDS) as eds:
        await eds.send()
        first = await eds.receive()
        assert hosts_of(first) == [A, B]
        await eds.send(version=first.version_info, nonce=first.nonce)
        assert await eds.silent()
        control_plane.store.publish(fleet(C))
        assert hosts_of(await eds.receive()) == [C]


async def test_plain_eds_wildcard_gets_the_default_cluster(control_plane: ControlPlane) -> None:
    async with client(control_plane.target, EDS) as eds:
        await eds.send(names=[])
        assert hosts_of(await eds.receive()) == [A, B]


async def test_nack_over_grpc_is_counted_and_not_answered(control_plane: ControlPlane) -> None:
    async with client(control_plane.target) as xds:
        await xds.send()
        first = await xds.receive()
        await xds.send(version=first.version_info, nonce=first.nonce)
        control_plane.store.publish(fleet(C))
        bad = await xds.receive()
        before = metric("prefix_router_cp_xds_nacks_total")
        await xds.send(version=first.version_info, nonce=bad.nonce, error="no thanks")
        assert await xds.silent()
        assert metric("prefix_router_cp_xds_nacks_total") == before + 1
        control_plane.store.publish(fleet(A, C))
        assert hosts_of(await xds.receive()) == [A, C]


async def test_every_stream_is_served_independently(control_plane: ControlPlane) -> None:
    async with client(control_plane.target) as one, client(control_plane.target, EDS) as two:
        await one.send()
        await two.send()
        first_one, first_two = await one.receive(), await two.receive()
        assert first_one.nonce == first_two.nonce == "1"
        await one.send(version=first_one.version_info, nonce=first_one.nonce)
        await two.send(version=first_two.version_info, nonce=first_two.nonce)
        control_plane.store.publish(fleet(B))
        assert hosts_of(await one.receive()) == [B]
        assert hosts_of(await two.receive()) == [B]


async def test_stream_gauge_follows_open_streams(control_plane: ControlPlane) -> None:
    base = metric("prefix_router_cp_xds_streams")
    async with client(control_plane.target) as xds:
        await xds.send()
        await xds.receive()
        assert metric("prefix_router_cp_xds_streams") == base + 1
    await wait_until_async(
        lambda: metric("prefix_router_cp_xds_streams") == base,
        2,
        "the stream gauge to drop back",
        interval_s=0.02,
    )
    assert metric("prefix_router_cp_xds_streams") == base


async def test_many_publishes_arrive_in_order_ending_at_the_latest(
    control_plane: ControlPlane,
) -> None:
    async with client(control_plane.target) as xds:
        await xds.send()
        last = await xds.receive()
        final = None
        for round_ in range(10):
            final = fleet(*(f"127.0.0.{i + 1}:9000" for i in range(round_ + 1)))
            control_plane.store.publish(final)
        assert final is not None
        # Updates may coalesce, but nonces rise and the last one is the latest fleet. Each
        # is ACKed, as Envoy and the router do: the next waits for the answer.
        await xds.send(version=last.version_info, nonce=last.nonce)
        for _ in range(11):
            response = await xds.receive()
            await xds.send(version=response.version_info, nonce=response.nonce)
            assert int(response.nonce) > int(last.nonce)
            last = response
            if cla_to_fleet(decode(response)[FLEET]) == final:
                break
        assert cla_to_fleet(decode(last)[FLEET]) == final


async def test_a_client_that_does_not_answer_gets_one_response_then_the_latest(
    control_plane: ControlPlane,
) -> None:
    async with client(control_plane.target) as xds:
        await xds.send()
        first = await xds.receive()
        # The client neither ACKs nor NACKs: however many changes come, nothing more is
        # sent on its stream (gRPC would buffer every one for a stuck client).
        final = None
        for round_ in range(50):
            final = fleet(*(f"127.0.0.{i + 1}:9000" for i in range(round_ % 20 + 1)), C)
            control_plane.store.publish(final)
        assert await xds.silent()
        # Its answer brings the latest at once, in one response.
        await xds.send(version=first.version_info, nonce=first.nonce)
        latest = await xds.receive()
        assert final is not None and cla_to_fleet(decode(latest)[FLEET]) == final
        assert await xds.silent()
