"""The router's load feed and LoRA-aware placement, with an injected clock and no sockets."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.picker.decide import Outcome, Strategy
from extproc.picker.hosts import Host, HostSet

X = "127.0.0.21:8000"
Y = "127.0.0.22:8000"
Z = "127.0.0.23:8000"
HOSTS = (X, Y, Z)
THRESHOLD = 4
MAX_AGE_S = 2.0
PROMPTS = 200


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def feed_stale() -> float:
    return REGISTRY.get_sample_value("prefix_router_load_feed_stale_total") or 0.0


def chat_body(text: str, model: str = "base") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def make_router(
    clock: FakeClock,
    strategy: Strategy = Strategy.PREFIX_AWARE,
    control_plane: str | None = "127.0.0.1:18000",
    hosts: HostSet | None = None,
) -> Router:
    config = RouterConfig(
        routing_strategy=strategy,
        concurrency_threshold=THRESHOLD,
        control_plane=control_plane,
        hosts=() if control_plane else HOSTS,
        load_feed_max_age_s=MAX_AGE_S,
        # These tests pin the absolute threshold; bounded loads and prefill queues have
        # their own tests (the fake clock stands still, so no queue would ever drain).
        balance_factor=None,
        prefill_tokens_per_s=None,
    )
    # One fake clock for both: the feed's wall-time stamps then read as this clock.
    router = Router(config, random.Random(3), clock=clock, wall_clock=clock)
    if control_plane:
        assert not router.ready.is_set()
        router.set_hosts(hosts or HostSet.of(HOSTS))
        assert router.ready.is_set()
    return router


def first_hosts(router: Router, count: int = PROMPTS) -> dict[bytes, str]:
    """Each prompt's first host, found with no load anywhere."""
    result = {}
    for index in range(count):
        body = chat_body(f"prompt number {index}")
        decision = router.route({}, body)
        router.finish(decision)
        assert decision.outcome is Outcome.PLACED
        result[body] = decision.primary
    assert set(result.values()) == set(HOSTS), "the prompts should spread over every host"
    return result


def test_feed_age_is_infinite_until_the_first_update() -> None:
    clock = FakeClock()
    router = make_router(clock)
    assert router.feed_age() == float("inf")
    router.set_feed({X: HostLoad(running=1)})
    clock.now += 0.5
    assert router.feed_age() == pytest.approx(0.5)


def test_fresh_feed_overflows_keys_whose_first_host_is_busy() -> None:
    clock = FakeClock()
    router = make_router(clock)
    placements = first_hosts(router)
    router.set_feed({X: HostLoad(running=THRESHOLD - 1, waiting=1)})
    clock.now += MAX_AGE_S / 2
    stale_before = feed_stale()
    for body, first in placements.items():
        decision = router.route({}, body)
        router.finish(decision)
        if first == X:
            assert decision.outcome is Outcome.OVERFLOW
            assert decision.primary != X
            assert X in decision.targets[1:]  # still a failover target
        else:
            assert decision.outcome is Outcome.PLACED
            assert decision.primary == first
    assert feed_stale() == stale_before


def test_feed_below_the_threshold_changes_nothing() -> None:
    clock = FakeClock()
    router = make_router(clock)
    placements = first_hosts(router)
    router.set_feed({X: HostLoad(running=THRESHOLD - 2, waiting=1)})
    for body, first in placements.items():
        decision = router.route({}, body)
        router.finish(decision)
        assert (decision.primary, decision.outcome) == (first, Outcome.PLACED)


def test_stale_feed_uses_local_counts_only_and_is_counted() -> None:
    clock = FakeClock()
    router = make_router(clock)
    placements = first_hosts(router)
    router.set_feed({X: HostLoad(running=100)})
    clock.now += MAX_AGE_S + 0.01
    stale_before = feed_stale()
    for body, first in placements.items():
        decision = router.route({}, body)
        router.finish(decision)
        assert (decision.primary, decision.outcome) == (first, Outcome.PLACED)
    assert feed_stale() == stale_before + len(placements)
    # A new update makes the feed fresh again.
    router.set_feed({X: HostLoad(running=100)})
    body = next(b for b, first in placements.items() if first == X)
    decision = router.route({}, body)
    router.finish(decision)
    assert decision.outcome is Outcome.OVERFLOW
    assert feed_stale() == stale_before + len(placements)


def test_local_count_wins_when_larger_than_the_feed() -> None:
    clock = FakeClock()
    router = make_router(clock)
    placements = first_hosts(router)
    x_bodies = [b for b, first in placements.items() if first == X]
    assert len(x_bodies) > THRESHOLD
    # The feed says X is idle, but this router has THRESHOLD requests open on it.
    router.set_feed({X: HostLoad()})
    held = [router.route({}, body) for body in x_bodies[:THRESHOLD]]
    assert all(d.primary == X for d in held)
    decision = router.route({}, x_bodies[THRESHOLD])
    assert decision.outcome is Outcome.OVERFLOW
    for d in [*held, decision]:
        router.finish(d)


def test_feed_is_ignored_without_a_control_plane() -> None:
    clock = FakeClock()
    router = make_router(clock, control_plane=None)
    assert router.ready.is_set()
    placements = first_hosts(router)
    router.set_feed({X: HostLoad(running=100)})
    stale_before = feed_stale()
    for body, first in placements.items():
        decision = router.route({}, body)
        router.finish(decision)
        assert decision.primary == first
    assert feed_stale() == stale_before


def test_least_outstanding_uses_the_fresh_feed() -> None:
    clock = FakeClock()
    router = make_router(clock, strategy=Strategy.LEAST_OUTSTANDING_REQUESTS)
    router.set_feed({X: HostLoad(running=5), Y: HostLoad(waiting=2)})
    for index in range(30):
        decision = router.route({}, chat_body(f"p{index}"))
        router.finish(decision)
        assert decision.primary == Z
        assert decision.outcome is Outcome.LEAST_LOADED


def test_random_ignores_the_feed_and_counts_no_staleness() -> None:
    clock = FakeClock()
    router = make_router(clock, strategy=Strategy.RANDOM)
    router.set_feed({X: HostLoad(running=100)})
    clock.now += MAX_AGE_S * 10
    stale_before = feed_stale()
    primaries = Counter()
    for index in range(90):
        decision = router.route({}, chat_body(f"p{index}"))
        router.finish(decision)
        primaries[decision.primary] += 1
    assert set(primaries) == set(HOSTS)
    assert feed_stale() == stale_before


# --- LoRA ------------------------------------------------------------------------------------


def lora_hosts() -> HostSet:
    return HostSet.of_hosts(
        [
            Host.of(X, frozenset({"base", "lora-a"})),
            Host.of(Y, frozenset({"base", "lora-a"})),
            Host.of(Z, frozenset({"base"})),
        ]
    )


def test_lora_requests_stay_on_the_hosts_that_have_the_adapter() -> None:
    router = make_router(FakeClock(), hosts=lora_hosts())
    primaries = Counter()
    for index in range(PROMPTS):
        decision = router.route({}, chat_body(f"adapter prompt {index}", model="lora-a"))
        router.finish(decision)
        assert set(decision.targets) <= {X, Y}
        primaries[decision.primary] += 1
    assert set(primaries) == {X, Y}


def test_lora_overflow_stays_within_the_adapter_hosts() -> None:
    clock = FakeClock()
    router = make_router(clock, hosts=lora_hosts())
    router.set_feed({X: HostLoad(running=THRESHOLD)})
    for index in range(50):
        decision = router.route({}, chat_body(f"busy adapter {index}", model="lora-a"))
        router.finish(decision)
        assert decision.primary == Y
        assert set(decision.targets) <= {X, Y}


@pytest.mark.parametrize("model", ["base", "nobody-has-this"])
def test_model_all_or_none_have_is_placed_over_every_host(model: str) -> None:
    router = make_router(FakeClock(), hosts=lora_hosts())
    primaries = Counter()
    for index in range(PROMPTS):
        decision = router.route({}, chat_body(f"prompt {index}", model=model))
        router.finish(decision)
        primaries[decision.primary] += 1
    assert set(primaries) == set(HOSTS)


def test_handed_off_decisions_count_on_top_of_the_feed_until_it_shows_them() -> None:
    clock = FakeClock()
    router = make_router(clock)
    placements = first_hosts(router)
    on_x = [body for body, first in placements.items() if first == X]
    router.set_feed({X: HostLoad(running=THRESHOLD - 2, scraped_at=clock.now - 0.1)})
    # Two requests whose streams closed at decision: the feed cannot show them yet.
    for body in on_x[:2]:
        decision = router.route({}, body)
        assert decision.primary == X
        router.hand_off(decision)
    assert router.ledger.in_flight.total() == 0
    # A feed whose scrape began before them still cannot.
    clock.now += 0.2
    router.set_feed({X: HostLoad(running=THRESHOLD - 2, scraped_at=clock.now - 0.3)})
    decision = router.route({}, on_x[2])
    router.finish(decision)
    assert decision.outcome is Outcome.OVERFLOW  # 2 in the feed + 2 unseen
    # One scraped after them shows them (or that they are done).
    clock.now += 0.25
    router.set_feed({X: HostLoad(running=THRESHOLD - 2, scraped_at=clock.now - 0.01)})
    decision = router.route({}, on_x[2])
    router.finish(decision)
    assert (decision.primary, decision.outcome) == (X, Outcome.PLACED)


def test_handed_off_decisions_count_without_a_fresh_feed() -> None:
    clock = FakeClock()
    router = make_router(clock, control_plane=None)
    placements = first_hosts(router)
    on_x = [body for body, first in placements.items() if first == X]
    for body in on_x[:THRESHOLD]:
        router.hand_off(router.route({}, body))
    decision = router.route({}, on_x[THRESHOLD])
    router.finish(decision)
    assert decision.outcome is Outcome.OVERFLOW
    # They stop counting after load_feed_max_age_s.
    clock.now += MAX_AGE_S + 0.01
    decision = router.route({}, on_x[THRESHOLD])
    router.finish(decision)
    assert (decision.primary, decision.outcome) == (X, Outcome.PLACED)
