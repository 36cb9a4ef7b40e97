from collections.abc import Sequence

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from prometheus_client import REGISTRY

from extproc.control.model import HostLoad
from extproc.control.resources import CLA_TYPE_URL, cla_to_fleet, cla_to_loads
from extproc.control.snapshot import FleetSnapshot, LoadSnapshot, PublishedHost, SnapshotStore
from extproc.control.xds_protocol import (
    MAX_REJECTED_VERSIONS,
    DiscoveryRequest,
    DiscoveryResponse,
    XdsStream,
)

A = "127.0.0.1:8001"
B = "127.0.0.2:8002"
C = "127.0.0.3:8003"
FLEET = "vllm"
LOAD = "vllm/load"
LDS_TYPE_URL = "type.googleapis.com/envoy.config.listener.v3.Listener"


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def nacks() -> float:
    return metric("prefix_router_cp_xds_nacks_total")


def requests_of(kind: str) -> float:
    return metric("prefix_router_cp_xds_requests_total", {"kind": kind})


def fleet(*addresses: str, name: str = FLEET) -> FleetSnapshot:
    return FleetSnapshot.build(name, [PublishedHost(a) for a in addresses])


class Driver:
    """A fake xDS client that checks the protocol's invariants on every response."""

    def __init__(self, store: SnapshotStore, defaults: Sequence[str] = (FLEET,)) -> None:
        self.stream = XdsStream(store, frozenset(defaults))
        self.responses: list[DiscoveryResponse] = []

    def _check(self, response: DiscoveryResponse | None) -> DiscoveryResponse | None:
        if response is None:
            return None
        assert response.type_url == CLA_TYPE_URL
        assert response.version_info
        assert response.nonce
        nonces = [int(r.nonce) for r in self.responses]
        assert response.nonce not in {r.nonce for r in self.responses}
        assert not nonces or int(response.nonce) > nonces[-1]
        assert len(response.resources) > 0
        for resource in response.resources:
            assert resource.type_url == CLA_TYPE_URL
        self.responses.append(response)
        return response

    @property
    def last(self) -> DiscoveryResponse:
        return self.responses[-1]

    def request(
        self,
        names: Sequence[str] = (FLEET, LOAD),
        version: str = "",
        nonce: str = "",
        error: str | None = None,
        type_url: str = CLA_TYPE_URL,
        node: str = "test-node",
    ) -> DiscoveryResponse | None:
        request = DiscoveryRequest(
            version_info=version, response_nonce=nonce, type_url=type_url, resource_names=names
        )
        request.node.id = node
        if error is not None:
            request.error_detail.code = 3
            request.error_detail.message = error
        return self._check(self.stream.on_request(request))

    def ack(self, names: Sequence[str] = (FLEET, LOAD)) -> DiscoveryResponse | None:
        return self.request(names, self.last.version_info, self.last.nonce)

    def nack(
        self, kept_version: str = "", names: Sequence[str] = (FLEET, LOAD)
    ) -> DiscoveryResponse | None:
        return self.request(names, kept_version, self.last.nonce, error="rejected by test")

    def pending(self) -> DiscoveryResponse | None:
        return self._check(self.stream.pending())


def decode(response: DiscoveryResponse) -> dict[str, endpoint_pb2.ClusterLoadAssignment]:
    found = {}
    for resource in response.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert resource.Unpack(cla)
        found[cla.cluster_name] = cla
    return found


@pytest.fixture
def store() -> SnapshotStore:
    store = SnapshotStore()
    store.publish(fleet(A, B))
    store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=3)}))
    return store


def test_initial_request_gets_subscribed_resources(store: SnapshotStore) -> None:
    driver = Driver(store)
    response = driver.request()
    assert response is not None
    clas = decode(response)
    assert set(clas) == {FLEET, LOAD}
    assert cla_to_fleet(clas[FLEET]) == store.get(FLEET)
    assert cla_to_loads(clas[LOAD]) == {A: HostLoad(running=3)}
    assert driver.stream.state.node == "test-node"
    assert driver.stream.state.subscribed == frozenset({FLEET, LOAD})


def test_initial_request_for_one_name_gets_only_it(store: SnapshotStore) -> None:
    driver = Driver(store)
    response = driver.request([FLEET])
    assert response is not None
    assert set(decode(response)) == {FLEET}


def test_ack_is_never_answered(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    before = requests_of("ack")
    assert driver.ack() is None
    assert requests_of("ack") == before + 1
    assert driver.stream.state.acked_version == driver.last.version_info
    # Nothing changed, so nothing is pending either.
    assert driver.pending() is None
    assert driver.ack() is None  # a repeated ACK of the same nonce is still silent


def test_publish_produces_a_response_with_only_the_changed_resource(
    store: SnapshotStore,
) -> None:
    driver = Driver(store)
    first = driver.request()
    assert first is not None
    driver.ack()
    store.publish(fleet(A, B, C))
    response = driver.pending()
    assert response is not None
    clas = decode(response)
    assert set(clas) == {FLEET}
    assert [h.address for h in cla_to_fleet(clas[FLEET]).hosts] == [A, B, C]
    assert response.version_info != first.version_info
    assert driver.pending() is None  # sent once only


def test_emptied_fleet_is_sent_as_a_cla_without_endpoints(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    driver.ack()
    store.publish(fleet())
    response = driver.pending()
    assert response is not None
    clas = decode(response)
    assert set(clas) == {FLEET}
    assert len(clas[FLEET].endpoints) == 0


def test_noop_publish_produces_nothing(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    driver.ack()
    assert store.publish(fleet(A, B)) is False
    assert driver.pending() is None


def test_resource_not_in_store_is_sent_once_published() -> None:
    store = SnapshotStore()
    driver = Driver(store)
    assert driver.request() is None
    store.publish(fleet(A))
    response = driver.pending()
    assert response is not None
    assert set(decode(response)) == {FLEET}
    driver.ack()
    store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(waiting=1)}))
    response = driver.pending()
    assert response is not None
    assert set(decode(response)) == {LOAD}


def test_stale_nonce_is_ignored(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    stale = driver.last
    driver.ack()
    store.publish(fleet(A))
    assert driver.pending() is not None
    acked = driver.stream.state.acked_version
    before_stale, before_nacks = requests_of("stale_nonce"), nacks()
    # An ACK, a NACK and a subscription change, all on the old nonce: every one ignored.
    assert driver.request(version=stale.version_info, nonce=stale.nonce) is None
    assert driver.request(nonce=stale.nonce, error="late") is None
    assert driver.request([FLEET, LOAD, "other"], nonce=stale.nonce) is None
    assert requests_of("stale_nonce") == before_stale + 3
    assert nacks() == before_nacks
    assert driver.stream.state.acked_version == acked
    assert driver.stream.state.subscribed == frozenset({FLEET, LOAD})
    assert not driver.stream.state.rejected
    # A nonce never sent is stale too.
    assert driver.request(nonce="999") is None
    # The current nonce still works.
    assert driver.ack() is None
    assert driver.stream.state.acked_version == driver.last.version_info


def test_nack_is_counted_and_the_rejected_version_not_resent(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    driver.ack()
    good_version = driver.last.version_info
    store.publish(fleet(A, C))
    rejected = driver.pending()
    assert rejected is not None
    before = nacks()
    assert driver.nack(kept_version=good_version) is None
    assert nacks() == before + 1
    # The rejected content is not sent again, however often the client asks.
    assert driver.pending() is None
    assert driver.request(version=good_version, nonce=rejected.nonce) is None
    assert store.publish(fleet(A, C)) is False
    assert driver.pending() is None
    # A newer version goes out.
    store.publish(fleet(A, B, C))
    response = driver.pending()
    assert response is not None
    assert [h.address for h in cla_to_fleet(decode(response)[FLEET]).hosts] == [A, B, C]
    assert driver.ack() is None
    assert nacks() == before + 1


def test_nack_then_the_rejected_content_again_is_not_resent(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    driver.ack()
    store.publish(fleet(C))
    driver.pending()
    driver.nack()
    store.publish(fleet(A))
    assert driver.pending() is not None
    driver.ack()
    # Content hashes: the rejected content comes back with the rejected version.
    store.publish(fleet(C))
    assert driver.pending() is None


def test_a_client_that_rejects_every_version_costs_bounded_memory(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    driver.ack()
    for n in range(3 * MAX_REJECTED_VERSIONS):
        store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=n + 10)}))
        assert driver.pending() is not None
        driver.nack()
    rejected = driver.stream.state.rejected
    assert len(rejected[LOAD]) == MAX_REJECTED_VERSIONS
    # The latest rejections are remembered: the one before last is still never resent...
    store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=3 * MAX_REJECTED_VERSIONS + 8)}))
    assert driver.pending() is None
    # ...while one rejected long ago is offered again.
    store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=10)}))
    assert driver.pending() is not None


def test_nack_of_the_load_feed_does_not_blacklist_the_acked_fleet(
    store: SnapshotStore,
) -> None:
    driver = Driver(store)
    driver.request()  # fleet(A, B) and the first load
    driver.ack()
    store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=9)}))
    response = driver.pending()
    assert response is not None
    assert set(decode(response)) == {LOAD}
    driver.nack()  # the client rejects the load update only
    store.publish(fleet(A))  # B ejected
    assert driver.pending() is not None
    driver.ack()
    store.publish(fleet(A, B))  # B readmitted: the same content as the ACKed first fleet
    response = driver.pending()
    assert response is not None, "the readmitted host is never sent to this client"
    assert [h.address for h in cla_to_fleet(decode(response)[FLEET]).hosts] == [A, B]


def test_subscribing_to_a_new_name_sends_only_it(store: SnapshotStore) -> None:
    store.publish(fleet(C, name="other"))
    driver = Driver(store)
    driver.request([FLEET])
    response = driver.request([FLEET, "other"], driver.last.version_info, driver.last.nonce)
    assert response is not None
    clas = decode(response)
    assert set(clas) == {"other"}
    assert [h.address for h in cla_to_fleet(clas["other"]).hosts] == [C]
    assert driver.stream.state.subscribed == frozenset({FLEET, "other"})


def test_unsubscribe_then_resubscribe_resends(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request([FLEET, LOAD])
    assert driver.request([FLEET], driver.last.version_info, driver.last.nonce) is None
    # An unsubscribed resource's changes are not sent.
    store.publish(LoadSnapshot.build(FLEET, {B: HostLoad(waiting=4)}))
    assert driver.pending() is None
    response = driver.request([FLEET, LOAD], driver.last.version_info, driver.last.nonce)
    assert response is not None
    clas = decode(response)
    assert set(clas) == {LOAD}
    assert cla_to_loads(clas[LOAD]) == {B: HostLoad(waiting=4)}


def test_unsupported_type_url_is_ignored(store: SnapshotStore) -> None:
    driver = Driver(store)
    before = requests_of("unsupported_type")
    assert driver.request(type_url=LDS_TYPE_URL) is None
    assert requests_of("unsupported_type") == before + 1
    assert driver.stream.state.subscribed == frozenset()
    # The stream still works for CLA afterwards.
    assert driver.request() is not None


def test_empty_resource_names_get_the_defaults(store: SnapshotStore) -> None:
    driver = Driver(store, defaults=(FLEET,))
    response = driver.request(names=[])
    assert response is not None
    assert set(decode(response)) == {FLEET}
    assert driver.stream.state.subscribed == frozenset({FLEET})


def test_empty_type_url_is_treated_as_cla(store: SnapshotStore) -> None:
    driver = Driver(store)
    response = driver.request(type_url="")
    assert response is not None
    assert set(decode(response)) == {FLEET, LOAD}


def test_nonces_increase_over_many_updates(store: SnapshotStore) -> None:
    driver = Driver(store)
    driver.request()
    driver.ack()
    for round_ in range(20):
        store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=round_ + 10)}))
        assert driver.pending() is not None
        # Nothing more goes out until the client answers this one.
        store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=round_ + 1000)}))
        assert driver.pending() is None
        store.publish(LoadSnapshot.build(FLEET, {A: HostLoad(running=round_ + 10)}))
        driver.ack()
    assert len(driver.responses) == 21
    assert [int(r.nonce) for r in driver.responses] == list(range(1, 22))
    assert len({r.version_info for r in driver.responses}) == 21


def test_streams_have_independent_state(store: SnapshotStore) -> None:
    one, two = Driver(store), Driver(store)
    assert one.request() is not None
    assert one.ack() is None
    # The second stream still gets everything, and its nonces start afresh.
    response = two.request()
    assert response is not None
    assert response.nonce == "1"
    assert set(decode(response)) == {FLEET, LOAD}
