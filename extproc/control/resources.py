"""Translate snapshots into Envoy's ClusterLoadAssignment, and back (for the routers)."""

from __future__ import annotations

from dataclasses import fields

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import any_pb2, struct_pb2

from extproc.control.model import HostLoad
from extproc.control.snapshot import (
    LOAD_SUFFIX,
    FleetSnapshot,
    LoadSnapshot,
    PublishedHost,
    Snapshot,
)

CLA_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# Endpoint metadata namespaces; Envoy ignores them, the routers read them.
HOST_METADATA = "prefix_router"
LOAD_METADATA = "prefix_router.load"
_LOAD_FIELDS = [f.name for f in fields(HostLoad)]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _add_endpoint(cla: endpoint_pb2.ClusterLoadAssignment, zone: str, address: str):  # type: ignore[no-untyped-def]
    group = next((g for g in cla.endpoints if g.locality.zone == zone), None)
    if group is None:
        group = cla.endpoints.add()
        group.locality.zone = zone
    lb_endpoint = group.lb_endpoints.add()
    ip, port = _split(address)
    lb_endpoint.endpoint.address.socket_address.address = ip
    lb_endpoint.endpoint.address.socket_address.port_value = port
    return lb_endpoint


def fleet_to_cla(snapshot: FleetSnapshot) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=snapshot.name)
    for host in snapshot.hosts:
        lb_endpoint = _add_endpoint(cla, host.zone, host.address)
        lb_endpoint.health_status = (
            health_check_pb2.DRAINING if host.draining else health_check_pb2.HEALTHY
        )
        metadata = lb_endpoint.metadata.filter_metadata[HOST_METADATA]
        metadata["models"] = list(host.models)
    return cla


def load_to_cla(snapshot: LoadSnapshot) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=snapshot.name)
    for address, load in snapshot.loads:
        lb_endpoint = _add_endpoint(cla, "", address)
        metadata = lb_endpoint.metadata.filter_metadata[LOAD_METADATA]
        for name in _LOAD_FIELDS:
            metadata[name] = float(getattr(load, name))
    return cla


def to_any(snapshot: Snapshot) -> any_pb2.Any:
    if isinstance(snapshot, FleetSnapshot):
        message = fleet_to_cla(snapshot)
    elif isinstance(snapshot, LoadSnapshot):
        message = load_to_cla(snapshot)
    else:  # pragma: no cover - the store only holds these two kinds
        raise TypeError(f"no xDS form for {type(snapshot).__name__}")
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _endpoints(cla: endpoint_pb2.ClusterLoadAssignment):  # type: ignore[no-untyped-def]
    for group in cla.endpoints:
        for lb_endpoint in group.lb_endpoints:
            socket = lb_endpoint.endpoint.address.socket_address
            ip = f"[{socket.address}]" if ":" in socket.address else socket.address
            yield group.locality.zone, f"{ip}:{socket.port_value}", lb_endpoint


def _struct_list(struct: struct_pb2.Struct, key: str) -> tuple[str, ...]:
    if key not in struct.fields:
        return ()
    return tuple(v.string_value for v in struct.fields[key].list_value.values)


def cla_to_fleet(cla: endpoint_pb2.ClusterLoadAssignment) -> FleetSnapshot:
    """The routers' view: hosts with their draining flag and models. Validates."""
    hosts = []
    for zone, address, lb_endpoint in _endpoints(cla):
        if lb_endpoint.health_status not in (
            health_check_pb2.HEALTHY,
            health_check_pb2.UNKNOWN,
            health_check_pb2.DRAINING,
        ):
            continue  # unhealthy or degraded hosts take no new prefixes
        metadata = lb_endpoint.metadata.filter_metadata.get(HOST_METADATA)
        models = _struct_list(metadata, "models") if metadata is not None else ()
        draining = lb_endpoint.health_status == health_check_pb2.DRAINING
        hosts.append(PublishedHost(address, draining, models, zone))
    return FleetSnapshot.build(cla.cluster_name, hosts)


def cla_to_loads(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, HostLoad]:
    loads = {}
    for _, address, lb_endpoint in _endpoints(cla):
        metadata = lb_endpoint.metadata.filter_metadata.get(LOAD_METADATA)
        if metadata is None:
            continue
        values = {k: metadata.fields[k].number_value for k in _LOAD_FIELDS if k in metadata.fields}
        loads[address] = HostLoad(**values)
    return loads


def is_load_resource(name: str) -> bool:
    return name.endswith(LOAD_SUFFIX)
