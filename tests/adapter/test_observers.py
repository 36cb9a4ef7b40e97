"""The router's observers: what each is told of a Router's decisions (the records a traffic
log writes, the shadow's counts, the live shares), and how a reload rebuilds them."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from extproc.adapter.observers import (
    LiveShares,
    Observer,
    Routed,
    ShadowObserver,
    TrafficLogObserver,
)
from extproc.adapter.routing import Router, key_chain
from extproc.adapter.traffic_log import read_records, salt_digest
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.picker.blocks import PromptBlocks
from extproc.picker.decide import Decision
from extproc.picker.hosts import HostSet
from extproc.picker.keys import KeyMode, extract_key
from extproc.picker.strategy import NO_WEIGHTS

HOSTS = tuple(f"127.0.0.{61 + i}:8000" for i in range(4))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


class Recorder(Observer):
    """Notes every call, as the router makes them."""

    name = "recorder"

    def __init__(self, reads_prompt: bool = False) -> None:
        self.reads_prompt = reads_prompt
        self.calls: list[tuple[str, object]] = []
        self.requests: list[Routed] = []

    def routed(self, request: Routed) -> None:
        self.requests.append(request)
        self.calls.append(("routed", request.decision))

    def moved(self, decision: Decision, to: Decision) -> None:
        self.calls.append(("moved", (decision, to)))

    def ended(self, decision: Decision) -> None:
        self.calls.append(("ended", decision))

    def hosts_changed(self, hosts: frozenset[str]) -> None:
        self.calls.append(("hosts_changed", hosts))

    def host_reset(self, host: str) -> None:
        self.calls.append(("host_reset", host))

    def cache_sizes(self, tokens: Mapping[str, float]) -> None:
        self.calls.append(("cache_sizes", dict(tokens)))

    def stop(self) -> None:
        self.calls.append(("stop", None))


def document(n: int, question: int = 0, salt: str | None = None) -> bytes:
    text = f"document {n} " + "text of the document " * 120 + f" question {question}"
    extra = {} if salt is None else {"prompt_cache_key": salt}
    messages = [{"role": "user", "content": text}]
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def chain_of(body: bytes, config: RouterConfig) -> PromptBlocks:
    return key_chain(extract_key(body, {}, KeyMode.OPENAI, config.match_depth_chars), 512)


def shadow_of(router: Router) -> ShadowObserver:
    shadow = router.observer(ShadowObserver)
    assert shadow is not None
    shadow.sync()
    return shadow


def test_the_config_builds_the_traffic_log_and_shadow_mode_and_each_is_told_every_request(
    tmp_path: Path,
) -> None:
    path = tmp_path / "traffic.log"
    config = RouterConfig(
        hosts=HOSTS, routing_strategy="RANDOM", shadow=True, traffic_log=str(path)
    )
    router = Router(config, random.Random(4), clock=Clock())
    kinds = [type(o) for o in router.observers]
    assert kinds == [LiveShares, TrafficLogObserver, ShadowObserver]
    bodies = [document(n % 5, n, salt="tenant" if n % 2 else None) for n in range(30)]
    decisions = [router.route({}, body) for body in bodies]
    shadow = shadow_of(router)
    assert shadow.requests == 30 and sum(shadow.predictions.in_flight.values()) == 30
    for decision in decisions:
        router.finish(decision)
    shadow.sync()
    assert shadow.requests == 0 and not shadow.predictions.in_flight
    predictions = shadow.predictions
    assert sum(predictions.requests.values()) == 30 == sum(router.routed.values())
    assert predictions.prompt_bytes == sum(chain_of(b, config).length for b in bodies)
    assert router.shadow_predictions is predictions
    # Live shares: the live strategy's own decisions, host by host.
    live: dict[str, int] = {}
    for decision in decisions:
        live[decision.primary] = live.get(decision.primary, 0) + 1
    assert dict(router.routed) == live
    router.close()  # the log's queue is written and its file closed
    records = list(read_records(path))
    assert len(records) == 30
    for record, body, n in zip(records, bodies, range(30), strict=True):
        blocks = chain_of(body, config)
        assert (record.hashes, record.whole, record.seed) == (
            blocks.hashes,
            blocks.whole,
            blocks.seed,
        )
        assert record.salt == (salt_digest("tenant") if n % 2 else None)
        assert record.fixed is not None and record.fixed[1] == config.prefix_length
    assert router.shadow_predictions is None and not shadow.worker._thread.is_alive()


def test_an_observer_is_told_each_decision_move_end_and_fleet_change() -> None:
    recorder = Recorder()
    config = RouterConfig(hosts=HOSTS, routing_strategy="RANDOM")
    router = Router(config, random.Random(4), clock=Clock(), observers=(recorder,))
    placement = router.place({}, document(1))
    first = placement.decision
    (request,) = recorder.requests
    assert request.decision is first and request.hosts == router.hosts
    # No observer reads the prompt or the weights: none is read for it.
    assert request.chain is None and request.weights is NO_WEIGHTS
    assert request.model == "m" and request.now > 0
    other = next(h for h in sorted(HOSTS) if h != first.primary)
    moved = router.served(placement, other)
    router.finish(moved)
    handed = router.route({}, document(2))
    router.hand_off(handed)
    # The live shares count the moved request where it went.
    expected = Counter({first.primary: 0})
    expected.update([other, handed.primary])
    assert router.routed == expected
    router.set_hosts(HostSet.of(HOSTS[:3]))
    router.set_feed(
        {h: HostLoad(cache_capacity_tokens=1000, prefix_cache_queries=5) for h in HOSTS[:3]}
    )
    router.set_feed(
        {h: HostLoad(cache_capacity_tokens=2000, prefix_cache_queries=1) for h in HOSTS[:1]}
    )
    router.close()
    assert recorder.calls == [
        ("routed", first),
        ("moved", (first, moved)),
        ("ended", moved),
        ("routed", handed),
        ("ended", handed),
        ("hosts_changed", frozenset(HOSTS[:3])),
        ("cache_sizes", dict.fromkeys(HOSTS[:3], 1000.0)),
        ("host_reset", HOSTS[0]),
        ("cache_sizes", {HOSTS[0]: 2000.0}),
        ("stop", None),
    ]
    assert set(router.routed) <= set(HOSTS[:3])  # a host that left lost its count


def test_an_observer_reading_the_prompt_gets_the_chain_hashed_once_for_all() -> None:
    readers = (Recorder(reads_prompt=True), Recorder(reads_prompt=True))
    config = RouterConfig(hosts=HOSTS, routing_strategy="LEAST_OUTSTANDING_REQUESTS")
    router = Router(config, random.Random(4), clock=Clock(), observers=readers)
    body = document(3, salt="blue")
    router.finish(router.route({}, body))
    (one,), (two,) = (r.requests for r in readers)
    assert one is two  # one record for all of them
    assert callable(one.chain) and one.salt == "blue"
    assert one.chain() is one.chain()  # hashed on first call, then kept
    assert one.chain().hashes == chain_of(body, config).hashes


def test_a_reload_turning_shadow_off_stops_its_worker_and_keeps_the_traffic_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "traffic.log"
    settings = {"hosts": HOSTS, "routing_strategy": "RANDOM", "traffic_log": str(path)}
    router = Router(RouterConfig(**settings, shadow=True), random.Random(4), clock=Clock())
    router.set_feed({h: HostLoad(cache_capacity_tokens=40_000) for h in HOSTS})
    log = router.observer(TrafficLogObserver)
    shadow = shadow_of(router)
    decision = router.route({}, document(1))
    router.config = RouterConfig(**settings, shadow=False)
    assert not shadow.worker._thread.is_alive()  # its thread ended with the reload
    assert router.observer(ShadowObserver) is None and router.shadow_predictions is None
    assert router.observer(TrafficLogObserver) is log  # its settings did not change
    router.finish(decision)  # shadowed before the reload, ended after it: nothing breaks
    # Turned on again: a new model, told the fleet as it stands.
    router.config = RouterConfig(**settings, shadow=True, hot_prefix_factor=3.0)
    again = shadow_of(router)
    assert again is not shadow and not again.predictions.requests
    assert again.predictions.index.capacity_of(HOSTS[0]) == router.index.capacity_of(HOSTS[0])
    # A reload that leaves the shadow's settings alone keeps it, model and all.
    router.finish(router.route({}, document(2)))
    router.config = RouterConfig(
        **{**settings, "routing_strategy": "LEAST_OUTSTANDING_REQUESTS"},
        shadow=True,
        hot_prefix_factor=3.0,
    )
    assert shadow_of(router) is again and sum(again.predictions.requests.values()) == 1
    router.close()
    assert not again.worker._thread.is_alive()
    assert len(list(read_records(path))) == 2
