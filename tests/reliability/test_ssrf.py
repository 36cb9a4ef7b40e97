"""A client can never make Envoy connect outside the published fleet.

Builds on tests/integration/test_routing_through_envoy.py::test_client_cannot_choose_the_
upstream (3 targets x 4 headers in each mode) with a wider set of hostile inputs and a
canary: loopback HTTP listeners outside the fleet that must receive nothing. Every hostile
target is a loopback address, so nothing can leave the machine. The unit tests check the
same property in the decision core, without sending traffic anywhere.
"""

from __future__ import annotations

import ipaddress
import json
import random
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.adapter import messages
from extproc.adapter.routing import Router
from extproc.bench.fleet_events import document
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.picker.decide import Strategy, decide
from extproc.picker.hosts import HostSet
from extproc.picker.placement import key_digest
from extproc.stack.local import LocalStack

from .stacks import reliability_spec
from .steady import CHAT, chat

# ---------------------------------------------------------------- through the real Envoy


class Canary(ThreadingHTTPServer):
    """Counts every connection and request that reaches it."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: int = socket.AF_INET) -> None:
        self.address_family = family
        self.requests: list[str] = []
        self.connections = 0
        super().__init__(address, _CanaryHandler)

    def get_request(self):  # type: ignore[no-untyped-def]
        self.connections += 1
        return super().get_request()


class _CanaryHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._record()

    def do_POST(self) -> None:
        self._record()

    def _record(self) -> None:
        assert isinstance(self.server, Canary)
        self.server.requests.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("x-served-by", "CANARY")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def start_canary(host: str, port: int, family: int = socket.AF_INET) -> Canary:
    canary = Canary((host, port), family)
    threading.Thread(target=canary.serve_forever, daemon=True).start()
    return canary


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


ROUTING_HEADERS = [
    "x-target-host",
    "X-Target-Host",
    "X-TARGET-HOST",
    "x-envoy-original-dst-host",
    "X-Envoy-Original-Dst-Host",
    "x-gateway-destination-endpoint",
    "X-Gateway-Destination-Endpoint",
]


@pytest.fixture(scope="module", params=["override-host", "original-dst"])
def hostile_stack(request) -> Iterator[tuple[LocalStack, list[Canary]]]:
    with LocalStack(reliability_spec(3, mode=request.param)) as stack:
        sim_port = stack.spec.backends[0][1]
        # Same port number as the fleet, on an address outside it.
        canaries = [start_canary("127.0.0.99", sim_port)]
        if ipv6_loopback():
            canaries.append(start_canary("::1", sim_port, socket.AF_INET6))
        try:
            yield stack, canaries
        finally:
            for canary in canaries:
                canary.shutdown()
                canary.server_close()


def hostile_targets(stack: LocalStack) -> list[str]:
    port = stack.spec.backends[0][1]
    admin = f"{stack.spec.admin[0]}:{stack.spec.admin[1]}"
    router = f"{stack.spec.router[0]}:{stack.spec.router[1]}"
    return [
        admin,
        router,
        f"127.0.0.99:{port}",
        f"[::1]:{port}",
        f"localhost:{port}",
        f"2130706531:{port}",  # 127.0.0.99 as one decimal number
        f"0x7f000063:{port}",  # ... and in hex
        f"127.0.0.99:{port},{admin}",  # an override_host failover list
        f"127.0.0.99:{port}, {stack.backend_addresses[0]}",  # hostile first, member second
        "127.0.0.99",  # no port
    ]


def attempts(stack: LocalStack) -> list[tuple[list[tuple[str, str]], dict]]:
    """(headers, body) pairs: every target in every header spelling, then the rest."""
    port = stack.spec.backends[0][1]
    canary = f"127.0.0.99:{port}"
    admin = f"{stack.spec.admin[0]}:{stack.spec.admin[1]}"
    body = chat(document(3))
    cases = [([(h, t)], body) for t in hostile_targets(stack) for h in ROUTING_HEADERS]
    cases += [
        # Duplicates: Envoy joins or keeps several values; none may be used.
        ([("x-target-host", canary), ("x-target-host", admin)], body),
        ([("x-gateway-destination-endpoint", canary), ("X-Target-Host", canary)], body),
        ([("x-envoy-original-dst-host", admin), ("x-envoy-original-dst-host", canary)], body),
        # Oversize values (Envoy's header limit is 60 KiB in all).
        ([("x-target-host", (canary + ",") * 500)], body),
        ([("x-gateway-destination-endpoint", "1" * 8000 + ":" + str(port))], body),
        # Near misses of the real header names.
        ([("x-target_host", canary)], body),
        ([("x-original-dst-host", canary), ("x-upstream-host", canary)], body),
    ]
    # Body fields posing as routing hints.
    for field in ["target_host", "x-target-host", "upstream", "x-gateway-destination-endpoint"]:
        cases.append(([], {**body, field: canary}))
    cases.append(
        ([], {**body, "metadata": {"envoy.lb": {"x-gateway-destination-endpoint": canary}}})
    )
    cases.append(([], {**body, "prompt_cache_key": canary, "user": admin}))
    return cases


def test_hostile_routing_attempts_never_leave_the_fleet(hostile_stack):
    stack, canaries = hostile_stack
    fleet = set(stack.backend_addresses)
    cases = attempts(stack)
    assert len(cases) >= 50
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        for headers, body in cases:
            response = client.post(
                CHAT,
                content=json.dumps(body).encode(),
                headers=[("content-type", "application/json"), *headers],
            )
            assert response.status_code == 200, (headers, response.status_code, response.text)
            assert response.headers.get("x-served-by") in fleet, headers
            assert response.headers.get("x-upstream-host") in fleet, headers
            assert response.json()["object"] == "chat.completion"
    for canary in canaries:
        assert canary.connections == 0 and canary.requests == []
    # The canaries work: a direct request reaches them.
    assert httpx.get(f"http://127.0.0.99:{stack.spec.backends[0][1]}/").headers["x-served-by"] == (
        "CANARY"
    )
    assert canaries[0].requests == ["GET /"]
    canaries[0].requests.clear()
    canaries[0].connections = 0


# ---------------------------------------------------------------- the decision core

PUBLISHED = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000", "[::1]:8001")
# Never published: link-local (cloud metadata), private ranges, loopback outside the
# fleet, the router's and Envoy's own ports.
FORBIDDEN = (
    "169.254.169.254:80",
    "169.254.0.1:8000",
    "10.0.0.1:8000",
    "10.255.255.254:443",
    "172.16.0.1:8000",
    "172.31.255.1:8000",
    "192.168.0.1:8000",
    "192.168.255.255:8000",
    "127.0.0.99:8000",
    "127.0.0.1:9901",
    "127.0.0.1:50051",
    "[fe80::1]:8000",
    "[fd00::1]:8000",
)


def test_the_forbidden_addresses_really_are_outside_and_non_public():
    for address in FORBIDDEN:
        host = address.rsplit(":", 1)[0].strip("[]")
        ip = ipaddress.ip_address(host)
        assert ip.is_private or ip.is_link_local or ip.is_loopback
        assert address not in PUBLISHED


hostile_text = st.sampled_from(FORBIDDEN) | st.text(max_size=40)


@settings(max_examples=1000, deadline=None, database=None, derandomize=True)
@given(
    digest=st.integers(0, 2**64 - 1),
    published=st.lists(st.sampled_from(PUBLISHED), min_size=1, unique=True),
    forbidden_loads=st.dictionaries(st.sampled_from(FORBIDDEN), st.integers(-5, 5)),
    member_loads=st.dictionaries(st.sampled_from(PUBLISHED), st.integers(0, 100)),
    strategy=st.sampled_from(list(Strategy)),
    threshold=st.integers(1, 64),
    failover=st.integers(0, 8),
    rand=st.floats(0, 1, exclude_max=True),
    balance=st.none() | st.floats(1.0, 10.0),
)
def test_decide_emits_only_published_hosts(
    digest, published, forbidden_loads, member_loads, strategy, threshold, failover, rand, balance
):
    """1,000 cases: loads that favour unpublished addresses (even negative ones) never
    put them in the target list."""
    hosts = HostSet.of(published)
    loads = {**member_loads, **forbidden_loads}
    decision = decide(digest, hosts, loads, strategy, threshold, failover, rand, balance)
    assert set(decision.targets) <= set(hosts.addresses)
    assert len(decision.targets) == len(set(decision.targets)) == min(1 + failover, len(hosts))


@settings(
    max_examples=800,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    header_values=st.lists(st.tuples(st.sampled_from(ROUTING_HEADERS), hostile_text), max_size=4),
    body_fields=st.dictionaries(
        st.sampled_from(["target_host", "x-target-host", "upstream", "model", "host"]),
        hostile_text,
    ),
    feed_hosts=st.lists(st.sampled_from(FORBIDDEN), max_size=5),
    strategy=st.sampled_from(list(Strategy)),
)
def test_router_ignores_hostile_headers_body_fields_and_feed_entries(
    header_values, body_fields, feed_hosts, strategy
):
    """800 cases through Router.route and the message builders: hostile headers, body
    fields and load-feed entries for unpublished hosts never reach a response."""
    router = Router(
        RouterConfig(control_plane="127.0.0.1:18000", routing_strategy=strategy),
        random.Random(1),
    )
    router.set_hosts(HostSet.of(PUBLISHED))
    # A fresh feed naming hosts outside the set as idle, and every member as busy.
    feed = {address: HostLoad(running=0.0) for address in feed_hosts}
    feed.update({address: HostLoad(running=1000.0) for address in HostSet.of(PUBLISHED).addresses})
    router.set_feed(feed)
    headers = {name.lower(): value for name, value in header_values}
    body = json.dumps({**chat(document(1)), **body_fields}).encode()
    decision = router.route(headers, body)
    router.finish(decision)
    published = set(HostSet.of(PUBLISHED).addresses)
    assert set(decision.targets) <= published
    response = messages.route_on_body(decision)
    (option,) = response.request_body.response.header_mutation.set_headers
    assert option.header.raw_value.decode() in published
    metadata = response.dynamic_metadata.fields[messages.LB_METADATA_NAMESPACE].struct_value
    assert set(metadata.fields[messages.LB_METADATA_KEY].string_value.split(",")) <= published


def test_models_subset_never_widens_the_set():
    # A request for a model only forbidden hosts "serve" cannot pull them in: they are not
    # in the set, so placement runs over the published hosts.
    hosts = HostSet.of(PUBLISHED)
    for model in ["lora-a", "sim-model", "169.254.169.254:80"]:
        decision = decide(
            key_digest(b"k", None),
            hosts.serving(model),
            {},
            Strategy.PREFIX_AWARE,
            32,
            8,
            0.5,
        )
        assert set(decision.targets) == set(hosts.addresses)
