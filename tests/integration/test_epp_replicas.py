"""Endpoint-picker replicas, active-active: two ``prefix-router epp`` processes (not one
supervisor's workers), each on its own loopback ports, telling each other their decisions
over tcp on loopback (``decision_exchange_bind``/``_peers`` in each one's config file), as
router replicas do (tests/integration/test_sidecar_replicas.py, the model of this test).

The pickers are asked directly, over ext_proc as a gateway asks (full-duplex streamed,
no subset hint, as Istio sends it). The hosts are names only: no engine answers and no
KV events come, so a picker learns where its sibling put a prompt from the sibling's
decisions or not at all. A new prompt's first placement is by hash, the same in both
pickers whatever they share, so agreeing on it would prove nothing. Each document is
therefore placed by picker A away from its hash home: A holds a request on that home
(its full-duplex stream kept open after the pick: the picker counts the request in
flight until the stream ends; ``concurrency_threshold`` 1) and the document overflows to
another host. Picker B, with nothing in flight, picks that host for the same document
only if A told it; without the exchange it picks the home. Static hosts, no load feed:
each picker's loads are its own requests, and no cache pressure weighs the hash order, so
both outcomes are deterministic.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from extproc.adapter.messages import LB_METADATA_KEY, ProcessingRequest, ProcessingResponse
from extproc.adapter.routing import Router
from extproc.adapter.service import SERVICE_NAME
from extproc.config import RouterConfig
from extproc.stack import prometheus
from extproc.stack.processes import ManagedProcess, free_ports, wait_until

from ..extproc_messages import request_body, request_headers
from ..prompts import document
from .exchange import APPLIED, PUBLISHED, ROUTING, held_on, wait_for_subscribers

HOSTS = ("127.0.0.81:8000", "127.0.0.82:8000", "127.0.0.83:8000")
POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
DOCS = range(6)
IN_FLIGHT = "prefix_router_in_flight_requests"


def body(text: str) -> bytes:
    return json.dumps(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    ).encode()


def picked(response: ProcessingResponse) -> str:
    """The endpoint in the picker's answer to the request headers."""
    headers = response.request_headers.response.header_mutation.set_headers
    return {o.header.key: o.header.raw_value.decode() for o in headers}[LB_METADATA_KEY]


class Replica:
    """One picker process: its ext_proc channel and its metrics."""

    def __init__(self, name: str, process: ManagedProcess, grpc_port: int, metrics_port: int):
        self.name = name
        self.process = process
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.process_stream = self.channel.stream_stream(
            f"/{SERVICE_NAME}/Process",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=ProcessingResponse.FromString,
        )

    def metric(self, name: str) -> float:
        return prometheus.total(prometheus.scrape(self.metrics_url), name)

    def idle(self) -> bool:
        return self.metric(IN_FLIGHT) == 0

    def pick(self, text: str) -> str:
        """One full-duplex stream, as a gateway opens it, reset once the pick is in (the
        request is over for the picker): the endpoint picked."""
        messages = [request_headers(POST, duplex=True), request_body(body(text))]
        call = self.process_stream(iter(messages), timeout=10)
        try:
            return picked(next(call))
        finally:
            call.cancel()  # the picker frees the slot once it sees it: wait for idle()


class Held:
    """A request kept in flight: its stream stays open after the pick until ``release``."""

    def __init__(self, replica: Replica, text: str) -> None:
        self._released = threading.Event()
        self._call = replica.process_stream(self._messages(text), timeout=60)
        self.host = picked(next(self._call))

    def _messages(self, text: str) -> Iterator[ProcessingRequest]:
        yield request_headers(POST, duplex=True)
        yield request_body(body(text))
        self._released.wait(60)

    def release(self) -> None:
        self._released.set()
        self._call.cancel()


def start_replica(
    name: str, tmp_path: Path, exchange: tuple[str, list[str]] | None
) -> tuple[ManagedProcess, int, int]:
    grpc_port, health_port, metrics_port = free_ports(3)
    config: dict[str, Any] = dict(ROUTING)
    if exchange is not None:
        config["decision_exchange_bind"], config["decision_exchange_peers"] = exchange
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [sys.executable, "-m", "extproc", "epp", "--bind-address", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port)]
    argv += ["--metrics-port", str(metrics_port), "--secure-serving=false"]
    argv += ["--config", str(path)]
    argv += [arg for host in HOSTS for arg in ("--host", host)]
    process = ManagedProcess(f"epp-{name}", argv, tmp_path / f"epp-{name}.log").start()
    return process, grpc_port, metrics_port


class Replicas:
    def __init__(self, a: Replica, b: Replica, shared: bool) -> None:
        self.a, self.b = a, b
        self.shared = shared
        # What a picker that knows no decision but its own does with a new prompt: the
        # pickers' own code, in this process, with their settings and hosts.
        self.oracle = Router(RouterConfig(hosts=HOSTS, **ROUTING))

    def placement_order(self, text: str) -> tuple[str, ...]:
        """Where an unshared picker sends ``text``, new to it, at an idle pool: first its
        hash home, then where it overflows."""
        decision = self.oracle.route(POST, body(text))
        self.oracle.finish(decision)
        return decision.targets


@pytest.fixture(params=[True, False], ids=["shared", "unshared"])
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Replicas]:
    share: bool = request.param
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    started: list[Replica] = []
    try:
        for i, name in enumerate(("a", "b")):
            exchange = (endpoints[i], [endpoints[1 - i]]) if share else None
            process, grpc_port, metrics_port = start_replica(name, tmp_path, exchange)
            started.append(Replica(name, process, grpc_port, metrics_port))
        for replica in started:
            try:
                wait_until(
                    lambda r=replica: r.metric("prefix_router_hosts") == len(HOSTS),
                    60,
                    what=f"picker {replica.name} to know the hosts",
                    ignoring=(OSError, httpx.HTTPError),
                )
            except AssertionError as error:
                raise AssertionError(f"{error}\n{replica.process.log_tail(40)}") from None
        if share:
            wait_for_subscribers(endpoints)
        pair = Replicas(started[0], started[1], share)
        try:
            yield pair
        finally:
            pair.oracle.close()
    finally:
        for replica in started:
            replica.channel.close()
            replica.process.stop(timeout=30)


def place_away_from_home(pair: Replicas, doc: int) -> tuple[str, str]:
    """Ask A for document ``doc`` while A holds a request on its hash home: returns (its
    home, the endpoint A picked)."""
    a = pair.a
    text = document(doc)
    home = pair.placement_order(text)[0]
    wait_until(a.idle, 10, what="picker A to have nothing in flight")
    held = Held(a, held_on(pair.placement_order, home, doc))
    try:
        assert held.host == home
        assert a.metric(IN_FLIGHT) == 1
        placed = a.pick(text)
    finally:
        held.release()
    wait_until(a.idle, 10, what="picker A's held request to end")
    assert placed != home, f"document {doc} was not moved off its home {home}"
    return home, placed


def b_picks(pair: Replicas, doc: int) -> str:
    """B's pick for document ``doc``, B having nothing in flight before or after."""
    b = pair.b
    wait_until(b.idle, 10, what="picker B to have nothing in flight")
    host = b.pick(document(doc))
    wait_until(b.idle, 10, what="picker B's request to end")
    return host


@pytest.mark.timeout(180)
def test_an_epp_replica_picks_a_prompts_endpoint_where_the_other_replica_put_it(
    replicas: Replicas,
):
    pair = replicas
    a, b = pair.a, pair.b
    for doc in DOCS:
        home, placed = place_away_from_home(pair, doc)
        if pair.shared:
            # B has recorded every decision A published: the document's, and the held
            # request's before it.
            published = 2 * (doc + 1)
            wait_until(
                lambda p=published: a.metric(PUBLISHED) == p,
                10,
                what=f"picker A to publish {published} decisions",
            )
            wait_until(
                lambda p=published: b.metric(APPLIED) >= p,
                10,
                what=f"picker B to apply A's {published} decisions",
            )
            assert b_picks(pair, doc) == placed, (doc, home, placed)
        else:
            # B knows only its own decisions: the document is new to it, and goes home.
            assert b_picks(pair, doc) == home, (doc, home, placed)
    if pair.shared:
        # ... and A has B's: each document's one pick by B.
        wait_until(lambda: a.metric(APPLIED) >= len(DOCS), 10, what="A to apply B's")
        assert b.metric(PUBLISHED) == a.metric(APPLIED) == len(DOCS)
        assert b.metric(APPLIED) == 2 * len(DOCS)
    else:
        for replica in (a, b):
            assert replica.metric(PUBLISHED) == 0
            assert replica.metric(APPLIED) == 0
