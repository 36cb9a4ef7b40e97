"""The router's xDS client: the host set and load feed from the control plane.

The router subscribes over ADS to the same ClusterLoadAssignment Envoy uses (so both agree
on placement) plus a ``<cluster>/load`` resource that only routers ask for, which carries
each host's vLLM load in endpoint metadata. It keeps the last known set through a
control-plane outage and reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import grpc
import structlog
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from extproc import keepalive, tls
from extproc.adapter import metrics
from extproc.adapter.routing import Router
from extproc.control.resources import CLA_TYPE_URL, cla_to_fleet, cla_to_loads, is_load_resource
from extproc.control.snapshot import LOAD_SUFFIX, SnapshotError
from extproc.picker.hosts import Host, HostSet

log = structlog.get_logger("fleet_client")

ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


def _describe(error: BaseException) -> str:
    """An error for the log: a gRPC error's status and details (a refused TLS handshake
    says why there), without the repr that would push them past the cut."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"[:400]
    return str(error)[:200]


class StreamEnded(Exception):
    """The control plane closed or broke the stream; reconnect."""


@dataclass(frozen=True)
class FleetTls:
    """TLS to the control plane: whom to trust and what to present, and the name its
    certificate must carry when not the target's IP."""

    credentials: grpc.ChannelCredentials
    server_name: str | None = None


class FleetClient:
    def __init__(
        self, router: Router, target: str, cluster: str, tls: FleetTls | None = None
    ) -> None:
        self._router = router
        self._target = target
        self._cluster = cluster
        self._tls = tls
        self._node_id = f"prefix-router-{socket.gethostname()}-{id(self):x}"
        # The current attempt of the current backoff (1: the first try after a session
        # that received the fleet), and whether this session has received anything.
        self.attempt = 0
        self._received = False

    def _request(
        self, version: str = "", nonce: str = "", error: str | None = None
    ) -> discovery_pb2.DiscoveryRequest:
        request = discovery_pb2.DiscoveryRequest(
            version_info=version,
            response_nonce=nonce,
            type_url=CLA_TYPE_URL,
            resource_names=[self._cluster, self._cluster + LOAD_SUFFIX],
        )
        request.node.id = self._node_id
        request.node.cluster = "prefix-router"
        if error is not None:
            request.error_detail.code = 3  # INVALID_ARGUMENT
            request.error_detail.message = error
        return request

    def apply(self, response: discovery_pb2.DiscoveryResponse) -> None:
        """Apply every resource in a response; raise SnapshotError to NACK it."""
        for resource in response.resources:
            cla = endpoint_pb2.ClusterLoadAssignment()
            if not resource.Unpack(cla):
                raise SnapshotError(f"resource of type {resource.type_url} is not a CLA")
            if is_load_resource(cla.cluster_name):
                self._router.set_feed(cla_to_loads(cla))
                metrics.FLEET_UPDATES.labels("load").inc()
            elif cla.cluster_name == self._cluster:
                fleet = cla_to_fleet(cla)
                hosts = HostSet.of_hosts(
                    Host.of(h.address, frozenset(h.models)) for h in fleet.serving
                )
                self._router.set_hosts(hosts)
                metrics.FLEET_UPDATES.labels("hosts").inc()
                log.info("fleet_updated", hosts=sorted(hosts.addresses))

    def _channel(self) -> grpc.aio.Channel:
        options: list[tuple[str, str | int]] = [
            *keepalive.channel_options(),
            # Each session's channel its own subchannel: grpc shares one connection backoff
            # among channels to one address, and over an outage it grew until a router took
            # 11 s to reconnect after a 30 s outage (1.2 s with its own; the session loop's
            # retries set the pace, as documented).
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self._tls is None:
            return grpc.aio.insecure_channel(self._target, options=options)
        options += tls.server_name_options(self._tls.server_name)
        return grpc.aio.secure_channel(self._target, self._tls.credentials, options=options)

    async def _session(self) -> None:
        async with self._channel() as channel:
            call = channel.stream_stream(
                ADS_METHOD,
                request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
                response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
            )()
            await call.write(self._request())
            version = ""
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise StreamEnded("the control plane closed the stream")
                response: discovery_pb2.DiscoveryResponse = message
                self._received = True
                metrics.CONTROL_PLANE_CONNECTED.set(1)
                try:
                    self.apply(response)
                except (SnapshotError, ValueError) as error:
                    log.error("fleet_update_rejected", error=str(error))
                    await call.write(self._request(version, response.nonce, str(error)))
                    continue
                version = response.version_info
                await call.write(self._request(version, response.nonce))

    async def run(self, stop: asyncio.Event) -> None:
        """Stay subscribed until ``stop``; the last known set survives every outage."""
        stopper = asyncio.create_task(stop.wait())
        try:
            # Each backoff ends with a session that received the fleet: after a healthy
            # session the next outage is retried from the shortest delay again.
            while not stop.is_set():
                await self._retry_until_a_session_ends(stop, stopper)
        finally:
            stopper.cancel()

    async def _retry_until_a_session_ends(
        self, stop: asyncio.Event, stopper: asyncio.Task[bool]
    ) -> None:
        """Connect, with backoff, until a session that received something ends (or stop)."""
        session: asyncio.Task[None] | None = None
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_exponential(multiplier=0.05, max=2.0),
                reraise=True,
            ):
                with attempt:
                    self.attempt = attempt.retry_state.attempt_number
                    self._received = False
                    session = asyncio.create_task(self._session())
                    await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    if stop.is_set():
                        return
                    error = session.exception()
                    metrics.CONTROL_PLANE_CONNECTED.set(0)
                    if error is not None:
                        log.warning(
                            "control_plane_unreachable",
                            target=self._target,
                            attempt=self.attempt,
                            error=_describe(error),
                        )
                        if self._received:
                            return  # a healthy session ended: a fresh backoff
                        raise error
        finally:
            if session is not None:
                if not session.done():
                    session.cancel()
                # Awaited even when done: its error, if any, is taken and dropped here.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await session
