"""Routers deployed as sidecars: two Envoys, each with a router process of its own as its
ext_proc, in front of the same simulated engines, the routers telling each other their
decisions over tcp on loopback (``decision_exchange_bind``/``_peers``).

The engines publish no KV events here, so a router learns where its sibling put a prompt
from the sibling's decisions or not at all. A new prompt's first placement is by hash,
the same in both routers whatever they share (tests/reliability/test_replicas.py), so
agreeing on it would prove nothing. Each document is therefore placed by router A away
from its hash home: A holds a long request on that home (``concurrency_threshold`` 1),
and the document overflows to another host. Router B, with nothing in flight, sends the
same document where A put it only if A told it; without the exchange it sends it home.
Static hosts, no load feed: each router's loads are its own requests, and no cache
pressure weighs the hash order, so both outcomes are deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.stack import prometheus
from extproc.stack.local import LocalStack, StackSpec
from extproc.stack.processes import ManagedProcess, free_ports, wait_until

from ..prompts import document
from .exchange import APPLIED, PUBLISHED, ROUTING, held_on, wait_for_subscribers

CHAT = "/v1/chat/completions"
HEADERS = {":method": "POST", ":path": CHAT, "content-type": "application/json"}
DOCS = range(6)
# Answer at once; a held request streams a token every 20 ms until it is cut.
SIM_ARGS = ("--ttft-ms", "0", "--itl-ms", "20")
HELD_TOKENS = 1000


def body(text: str, max_tokens: int = 1, stream: bool = False) -> bytes:
    return json.dumps(
        {
            "model": "sim-model",
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()


class Sidecars:
    """Three simulators, router A behind the stack's Envoy and router B (the stack's
    second replica) behind an Envoy of its own: two sidecar pairs."""

    def __init__(
        self, stack: LocalStack, envoy_b: ManagedProcess, url_b: str, shared: bool
    ) -> None:
        self.stack = stack
        self.shared = shared
        self.envoy_b = envoy_b
        self.urls = (stack.url, url_b)
        self.hosts = stack.backend_addresses
        # What a router that knows no decision but its own does with a new prompt: the
        # routers' own code, in this process, with their settings and hosts.
        self.oracle = Router(RouterConfig(hosts=self.hosts, **ROUTING))

    def metric(self, router: int, name: str) -> float:
        return self.stack.router_metric(name, router) or 0.0

    def in_flight(self, router: int) -> float:
        samples = prometheus.scrape(self.stack.replica_metrics_url(router))
        return prometheus.total(samples, "prefix_router_in_flight_requests")

    def placement_order(self, text: str) -> tuple[str, ...]:
        """Where an unshared router sends ``text``, new to it, at an idle fleet: first
        its hash home, then where it overflows."""
        decision = self.oracle.route(HEADERS, body(text))
        self.oracle.finish(decision)
        return decision.targets

    def served(self, router: int, text: str) -> str:
        """Send ``text`` through router ``router``'s Envoy: the engine that answered."""
        response = httpx.post(self.urls[router] + CHAT, content=body(text), timeout=10)
        assert response.status_code == 200, response.text[:200]
        return response.headers["x-served-by"]


@pytest.fixture(params=[True, False], ids=["shared", "unshared"])
def sidecars(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sidecars]:
    share: bool = request.param
    spec = StackSpec.ephemeral(
        3,
        control_plane=None,  # static hosts: no load feed, no cache-pressure weights
        sim_kv_events=False,
        sim_args=SIM_ARGS,
        router_settings=ROUTING,
        router_replicas=2,
        work_dir=tmp_path,
    )
    # The stack's Envoy is A's sidecar: router A (replica 0) is its only ext_proc endpoint.
    spec.envoy_settings = {"routers": (spec.router,)}
    stack = LocalStack(spec)
    stack.write_router_config()
    if share:
        endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
        for replica, own in enumerate(endpoints):
            path = stack.router_config_path(replica)
            config = yaml.safe_load(path.read_text())
            config["decision_exchange_bind"] = own
            config["decision_exchange_peers"] = [e for e in endpoints if e != own]
            path.write_text(yaml.safe_dump(config, sort_keys=False))
    with stack:
        if share:
            wait_for_subscribers(endpoints)
        router_b = stack.router_addresses[1][0]
        envoy_b, url_b, _ = stack.start_envoy_beside("envoy-b", tmp_path, routers=(router_b,))
        pair = Sidecars(stack, envoy_b, url_b, share)
        try:
            yield pair
        finally:
            # Router B before its Envoy, as the stack stops A: a draining router waits
            # for its Envoy's next health check.
            stack.stop_router(1)
            envoy_b.stop()
            pair.oracle.close()


def place_away_from_home(pair: Sidecars, doc: int) -> tuple[str, str]:
    """Send document ``doc`` through A while A holds a request on its hash home: returns
    (its home, the host A sent it to)."""
    text = document(doc)
    home = pair.placement_order(text)[0]
    held = held_on(pair.placement_order, home, doc)
    with (
        httpx.Client(base_url=pair.urls[0], timeout=30) as client,
        client.stream("POST", CHAT, content=body(held, HELD_TOKENS, stream=True)) as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["x-served-by"] == home
        assert pair.in_flight(0) == 1
        placed = pair.served(0, text)
    # Cut short: A counts nothing in flight before the next document.
    wait_until(lambda: pair.in_flight(0) == 0, 10, what="router A's held request to end")
    assert placed != home, f"document {doc} was not moved off its home {home}"
    return home, placed


@pytest.mark.timeout(180)
def test_a_sidecar_router_sends_a_prompt_where_the_other_sidecar_put_it(sidecars: Sidecars):
    pair = sidecars
    for doc in DOCS:
        home, placed = place_away_from_home(pair, doc)
        if pair.shared:
            # B has recorded every decision A published: the document's, and the held
            # request's before it.
            published = 2 * (doc + 1)
            wait_until(
                lambda p=published: pair.metric(0, PUBLISHED) == p,
                10,
                what=f"router A to publish {published} decisions",
            )
            wait_until(
                lambda p=published: pair.metric(1, APPLIED) >= p,
                10,
                what=f"router B to apply A's {published} decisions",
            )
            assert pair.served(1, document(doc)) == placed, (doc, home, placed)
        else:
            # B knows only its own decisions: the document is new to it, and goes home.
            assert pair.served(1, document(doc)) == home, (doc, home, placed)
    if pair.shared:
        # ... and A has B's: each document's one request through B.
        wait_until(lambda: pair.metric(0, APPLIED) >= len(DOCS), 10, what="A to apply B's")
        assert pair.metric(1, PUBLISHED) == pair.metric(0, APPLIED) == len(DOCS)
        assert pair.metric(1, APPLIED) == 2 * len(DOCS)
    else:
        for router in (0, 1):
            assert pair.metric(router, PUBLISHED) == 0
            assert pair.metric(router, APPLIED) == 0
