"""A client can never make Envoy connect outside the published fleet.

Builds on tests/integration/test_routing_through_envoy.py::test_client_cannot_choose_the_
upstream (3 targets x 4 headers in each mode) with a wider set of hostile inputs and a
canary: loopback HTTP listeners outside the fleet that must receive nothing. Every hostile
target is a loopback address, so nothing can leave the machine. The unit tests check the
same property in the decision core, without sending traffic anywhere.
"""

from __future__ import annotations

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
from extproc.config import PrefixMatch, RouterConfig
from extproc.control.model import HostLoad
from extproc.picker.decide import Strategy
from extproc.picker.hosts import Host, HostSet
from extproc.stack.local import LocalStack

from ..picker.by_name import decide
from ..prompts import document
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

# The published hosts and the models each serves, as the control plane publishes them
# (from /v1/models): the base model everywhere, LoRA adapters on some hosts only, so the
# router's model filter (HostSet.serving) narrows the set for lora-a and lora-b.
SERVES = {
    "127.0.0.11:8000": frozenset({"sim-model", "lora-a"}),
    "127.0.0.12:8000": frozenset({"sim-model", "lora-a"}),
    "127.0.0.13:8000": frozenset({"sim-model", "lora-b"}),
    "[::1]:8001": frozenset({"sim-model"}),
}
PUBLISHED = tuple(SERVES)
# Where a request for each model may go: the hosts that have it. A model every host has,
# or none has, may go to any published host.
ALLOWED = {
    "lora-a": frozenset({"127.0.0.11:8000", "127.0.0.12:8000"}),
    "lora-b": frozenset({"127.0.0.13:8000"}),
}
ANYWHERE = frozenset(PUBLISHED)
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
    "127.0.0.1:9290",
    "[fe80::1]:8000",
    "[fd00::1]:8000",
)
# Every way the router decides: the strategies, and PREFIX_AWARE's two matchers.
DECIDERS = [
    {"routing_strategy": Strategy.RANDOM},
    {"routing_strategy": Strategy.LEAST_OUTSTANDING_REQUESTS},
    {"routing_strategy": Strategy.PREFIX_AWARE, "prefix_match": PrefixMatch.LONGEST},
    {"routing_strategy": Strategy.PREFIX_AWARE, "prefix_match": PrefixMatch.FIXED},
]


def published_hosts(addresses: tuple[str, ...] = PUBLISHED) -> HostSet:
    return HostSet.of_hosts(Host.of(a, SERVES[a]) for a in addresses)


def hostile_router(feed_hosts: tuple[str, ...], **settings: object) -> Router:
    """A control-plane router over the published hosts with a fresh load feed that names
    ``feed_hosts`` (outside the set) idle and every member busy."""
    config = RouterConfig(control_plane="127.0.0.1:18000", **settings)  # type: ignore[arg-type]
    router = Router(config, random.Random(1))
    router.set_hosts(published_hosts())
    feed = {address: HostLoad(running=0.0) for address in feed_hosts}
    feed.update({address: HostLoad(running=1000.0) for address in PUBLISHED})
    router.set_feed(feed)
    return router


def route(router: Router, headers: dict[str, str], body: dict[str, object]) -> set[str]:
    """The targets of one request, checked in the router's decision and in the response
    Envoy gets (the header for original-dst, the metadata for override-host) alike."""
    decision = router.route(headers, json.dumps(body).encode())
    router.finish(decision)
    response = messages.route_on_body(messages.destination(decision))
    (option,) = response.request_body.response.header_mutation.set_headers
    assert option.header.raw_value.decode() == decision.primary
    metadata = response.dynamic_metadata.fields[messages.LB_METADATA_NAMESPACE].struct_value
    sent = metadata.fields[messages.LB_METADATA_KEY].string_value.split(",")
    assert sent == list(decision.targets)
    assert len(sent) == len(set(sent)) > 0
    return set(sent)


@pytest.mark.parametrize("settings", DECIDERS, ids=lambda d: "-".join(map(str, d.values())))
def test_no_forbidden_address_comes_out_of_the_router(settings):
    """Each forbidden address named in every routing header, in body fields (the model
    among them) and as an idle host in the load feed: the router still sends only
    published hosts."""
    router = hostile_router(FORBIDDEN, **settings)
    for address in FORBIDDEN:
        headers = {name.lower(): address for name in ROUTING_HEADERS}
        body = {
            **chat(document(1)),
            "model": address,
            "target_host": address,
            "upstream": address,
            "prompt_cache_key": address,
        }
        targets = route(router, headers, body)
        assert targets <= ANYWHERE, (address, targets)
        assert len(targets) == 3  # the primary and failover_hosts (2) more, all members


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
    hosts = published_hosts(tuple(published))
    loads = {**member_loads, **forbidden_loads}
    decision = decide(digest, hosts, loads, strategy, threshold, failover, rand, balance)
    assert set(decision.targets) <= set(published)
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
    model=st.sampled_from(["lora-a", "lora-b", "sim-model"]) | hostile_text,
    feed_hosts=st.lists(st.sampled_from(FORBIDDEN), max_size=5),
    settings=st.sampled_from(DECIDERS),
)
def test_router_ignores_hostile_headers_body_fields_and_feed_entries(
    header_values, body_fields, model, feed_hosts, settings
):
    """800 cases through Router.route and the message builders: hostile headers, body
    fields and load-feed entries for unpublished hosts never reach a response, and a
    request for a LoRA adapter goes only to the hosts that have it."""
    router = hostile_router(tuple(feed_hosts), **settings)
    headers = {name.lower(): value for name, value in header_values}
    body = {**chat(document(1)), "model": model, **body_fields}
    targets = route(router, headers, body)
    assert targets <= ALLOWED.get(body["model"], ANYWHERE), (body["model"], targets)


@pytest.mark.parametrize("settings", DECIDERS, ids=lambda d: "-".join(map(str, d.values())))
def test_the_model_filter_narrows_the_set_and_never_widens_it(settings):
    """Every target the router may choose (failover 8 lists them all): only the hosts that
    have the model, and a model no published host has (an address posing as one, say)
    cannot pull anything in: placement runs over the published hosts."""
    router = hostile_router(FORBIDDEN, failover_hosts=8, **settings)
    expected = {
        "lora-a": {"127.0.0.11:8000", "127.0.0.12:8000"},
        "lora-b": {"127.0.0.13:8000"},
        "sim-model": set(PUBLISHED),
        "169.254.169.254:80": set(PUBLISHED),
        "127.0.0.99:8000": set(PUBLISHED),
    }
    for model, hosts in expected.items():
        for doc in range(5):
            targets = route(router, {}, {**chat(document(doc)), "model": model})
            assert targets == hosts, (model, doc, targets)
