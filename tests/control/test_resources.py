from typing import Any

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given
from hypothesis import strategies as st

from extproc.control.model import HostLoad
from extproc.control.resources import (
    CLA_TYPE_URL,
    HOST_METADATA,
    LOAD_METADATA,
    cla_to_fleet,
    cla_to_loads,
    fleet_to_cla,
    is_load_resource,
    load_to_cla,
    to_any,
)
from extproc.control.snapshot import FleetSnapshot, LoadSnapshot, PublishedHost, SnapshotError

A = "127.0.0.1:8001"
B = "127.0.0.2:8002"
C = "[::1]:8003"


def endpoints(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, Any]:
    found = {}
    for group in cla.endpoints:
        for lb in group.lb_endpoints:
            socket = lb.endpoint.address.socket_address
            found[f"{socket.address}:{socket.port_value}|{group.locality.zone}"] = lb
    return found


def test_fleet_round_trip() -> None:
    fleet = FleetSnapshot.build(
        "vllm",
        [
            PublishedHost(A, models=("base", "lora-a"), zone="z1"),
            PublishedHost(B, draining=True, models=("base",), zone="z2"),
            PublishedHost(C, zone="z1"),
        ],
    )
    back = cla_to_fleet(fleet_to_cla(fleet))
    assert back == fleet
    assert back.version == fleet.version


@given(
    st.dictionaries(
        st.tuples(st.integers(1, 254), st.integers(1, 65535)),
        st.tuples(
            st.booleans(),
            st.lists(st.sampled_from(["m1", "m2", "lora-x"]), max_size=3),
            st.sampled_from(["", "za", "zb"]),
        ),
        max_size=6,
    )
)
def test_fleet_round_trip_property(
    entries: dict[tuple[int, int], tuple[bool, list[str], str]],
) -> None:
    hosts = [
        PublishedHost(f"127.0.1.{ip}:{port}", draining, tuple(models), zone)
        for (ip, port), (draining, models, zone) in entries.items()
    ]
    fleet = FleetSnapshot.build("c", hosts)
    assert cla_to_fleet(fleet_to_cla(fleet)) == fleet


def test_fleet_cla_shape() -> None:
    fleet = FleetSnapshot.build(
        "vllm",
        [
            PublishedHost(A, models=("m",), zone="z1"),
            PublishedHost(B, draining=True, zone="z1"),
            PublishedHost(C, zone="z2"),
        ],
    )
    cla = fleet_to_cla(fleet)
    assert cla.cluster_name == "vllm"
    # One locality group per zone.
    assert sorted(g.locality.zone for g in cla.endpoints) == ["z1", "z2"]
    found = endpoints(cla)
    assert set(found) == {"127.0.0.1:8001|z1", "127.0.0.2:8002|z1", "::1:8003|z2"}
    assert found["127.0.0.1:8001|z1"].health_status == health_check_pb2.HEALTHY
    assert found["127.0.0.2:8002|z1"].health_status == health_check_pb2.DRAINING
    assert found["::1:8003|z2"].health_status == health_check_pb2.HEALTHY
    models = found["127.0.0.1:8001|z1"].metadata.filter_metadata[HOST_METADATA]["models"]
    assert list(models) == ["m"]


def test_draining_becomes_draining_health_status_and_back() -> None:
    fleet = FleetSnapshot.build("vllm", [PublishedHost(A, draining=True)])
    cla = fleet_to_cla(fleet)
    (lb,) = endpoints(cla).values()
    assert lb.health_status == health_check_pb2.DRAINING
    back = cla_to_fleet(cla)
    assert back.hosts[0].draining
    assert back.serving == ()


def test_empty_fleet_gives_a_cla_without_endpoints() -> None:
    cla = fleet_to_cla(FleetSnapshot.build("vllm", []))
    assert cla.cluster_name == "vllm"
    assert len(cla.endpoints) == 0
    assert cla_to_fleet(cla).hosts == ()


@pytest.mark.parametrize(
    "status",
    [
        health_check_pb2.UNHEALTHY,
        health_check_pb2.DEGRADED,
        health_check_pb2.TIMEOUT,
    ],
)
def test_unhealthy_endpoint_is_dropped(status: int) -> None:
    cla = fleet_to_cla(FleetSnapshot.build("vllm", [PublishedHost(A), PublishedHost(B)]))
    endpoints(cla)["127.0.0.2:8002|"].health_status = status
    assert [h.address for h in cla_to_fleet(cla).hosts] == [A]


def test_unknown_health_status_counts_as_serving() -> None:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="vllm")
    lb = cla.endpoints.add().lb_endpoints.add()
    lb.endpoint.address.socket_address.address = "127.0.0.1"
    lb.endpoint.address.socket_address.port_value = 8001
    fleet = cla_to_fleet(cla)
    assert fleet.hosts == (PublishedHost(A),)
    assert fleet.serving == fleet.hosts


def test_cla_to_fleet_validates_duplicates() -> None:
    cla = fleet_to_cla(FleetSnapshot.build("vllm", [PublishedHost(A)]))
    cla.endpoints.add().CopyFrom(cla.endpoints[0])
    with pytest.raises(SnapshotError, match="duplicate"):
        cla_to_fleet(cla)


def test_cla_to_fleet_validates_addresses() -> None:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="vllm")
    lb = cla.endpoints.add().lb_endpoints.add()
    lb.endpoint.address.socket_address.address = "not-an-ip"
    lb.endpoint.address.socket_address.port_value = 80
    with pytest.raises(SnapshotError):
        cla_to_fleet(cla)


def test_load_round_trip() -> None:
    loads = {
        A: HostLoad(
            running=3,
            waiting=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            scraped_at=1_700_000_000.25,
        ),
        B: HostLoad(running=0, waiting=7),
    }
    snap = LoadSnapshot.build("vllm", loads)
    cla = load_to_cla(snap)
    assert cla.cluster_name == "vllm/load"
    for lb in endpoints(cla).values():
        assert LOAD_METADATA in lb.metadata.filter_metadata
    back = cla_to_loads(cla)
    assert back == loads
    assert back[A].outstanding == 5
    assert back[B].outstanding == 7


def test_cla_to_loads_skips_endpoints_without_load_metadata() -> None:
    cla = fleet_to_cla(FleetSnapshot.build("vllm", [PublishedHost(A)]))
    assert cla_to_loads(cla) == {}


def test_to_any_packs_a_cla() -> None:
    fleet = FleetSnapshot.build("vllm", [PublishedHost(A)])
    packed = to_any(fleet)
    assert packed.type_url == CLA_TYPE_URL
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert packed.Unpack(cla)
    assert cla == fleet_to_cla(fleet)
    load_packed = to_any(LoadSnapshot.build("vllm", {A: HostLoad(running=1)}))
    assert load_packed.type_url == CLA_TYPE_URL
    assert load_packed.Unpack(cla)
    assert cla.cluster_name == "vllm/load"


def test_is_load_resource() -> None:
    assert is_load_resource("vllm/load")
    assert not is_load_resource("vllm")
    assert not is_load_resource("vllm/loads")
