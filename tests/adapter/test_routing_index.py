"""The router with its prefix index: conversations, documents, the feed's cache sizes and
restarts, fleet changes, config reloads, and SageMaker's fixed-length mode."""

from __future__ import annotations

import json
import random
from collections import Counter

from prometheus_client import REGISTRY

from extproc.adapter.routing import Router
from extproc.config import PrefixMatch, RouterConfig
from extproc.control.model import HostLoad
from extproc.picker.decide import Outcome
from extproc.picker.hosts import HostSet

HOSTS = tuple(f"127.0.0.{21 + i}:8000" for i in range(4))
SYSTEM = "You are a careful assistant. " * 40  # ~1.1k characters shared by every chat


class TickingClock:
    """Time that moves on a little at every reading, as it does between requests, so each
    host's prefill queue drains between them."""

    def __init__(self, step_s: float = 0.1) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def router(clock=None, **settings) -> Router:
    return Router(
        RouterConfig(hosts=HOSTS, **settings), random.Random(5), clock=clock or TickingClock()
    )


def chat(messages, model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": messages}).encode()


def route(r: Router, body: bytes, headers=None) -> str:
    decision = r.route(headers or {}, body)
    r.finish(decision)
    return decision.primary


def test_every_turn_of_a_conversation_lands_where_it_started():
    r = router()
    # A router that has just started does not know yet that the system prompt is shared by
    # everyone: its first few requests teach it (MIN_HOT_REQUESTS).
    for n in range(3):
        route(r, chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{n}"}]))
    histories = {c: [{"role": "system", "content": SYSTEM}] for c in range(40)}
    homes: dict[int, set[str]] = {c: set() for c in histories}
    for turn in range(4):
        for c, history in histories.items():
            history.append({"role": "user", "content": f"conversation {c} turn {turn} " * 3})
            homes[c].add(route(r, chat(history)))
            history.append({"role": "assistant", "content": f"answer {c}.{turn} " * 30})
    assert all(len(h) == 1 for h in homes.values())
    spread = Counter(next(iter(h)) for h in homes.values())
    assert len(spread) == len(HOSTS) and min(spread.values()) >= 5


def test_documents_keep_their_host_whatever_the_question():
    r = router()
    homes: dict[int, set[str]] = {}
    for question in range(5):
        for d in range(16):
            body = chat([{"role": "system", "content": f"document {d}: " + "text " * 400},
                         {"role": "user", "content": f"question {question}"}])  # fmt: skip
            homes.setdefault(d, set()).add(route(r, body))
    assert all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) == len(HOSTS)


def test_cache_sizes_from_the_feed_bound_each_host_and_a_restart_forgets_it():
    r = router(block_bytes=64)
    body = chat([{"role": "user", "content": "x" * 64 * 100}])
    host = route(r, body)
    assert r.index.host_sizes()[host] == 100
    # 50 tokens at 4 characters each: 3 blocks of 64 bytes.
    r.set_feed({a: HostLoad(prefix_cache_queries=10, cache_capacity_tokens=50) for a in HOSTS})
    assert r.index.host_sizes()[host] == 3
    # The bound the metrics show: 3 blocks for each of the hosts it places over.
    assert REGISTRY.get_sample_value("prefix_router_index_capacity_blocks") == 3 * len(HOSTS)
    evicted = REGISTRY.get_sample_value(
        "prefix_router_index_evicted_blocks_total", {"reason": "capacity"}
    )
    assert evicted is not None and evicted >= 97
    r.set_feed({a: HostLoad(prefix_cache_queries=1, cache_capacity_tokens=50) for a in HOSTS})
    assert host not in r.index.host_sizes()  # the counters went back: the engine restarted
    assert REGISTRY.get_sample_value("prefix_router_index_blocks") == len(r.index) == 0


def test_a_host_that_leaves_the_fleet_leaves_the_index():
    r = router()
    body = chat([{"role": "user", "content": "y" * 5000}])
    host = route(r, body)
    r.set_hosts(HostSet.of([a for a in HOSTS if a != host]))
    assert host not in r.index.host_sizes()
    assert route(r, body) != host


def test_a_reload_that_changes_what_the_index_means_clears_it():
    r = router()
    route(r, chat([{"role": "user", "content": "z" * 5000}]))
    r.config = r.config.replace(concurrency_threshold=8)
    assert len(r.index) > 0  # the entries still mean the same
    r.config = r.config.replace(block_bytes=256)
    assert len(r.index) == 0 and r.popularity.requests == 0


def test_requests_sharing_only_a_system_prompt_are_not_pulled_to_one_host():
    r = router()
    hosts = Counter()
    for n in range(200):
        body = chat([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"one-off question {n}"}])  # fmt: skip
        hosts[route(r, body)] += 1
    assert len(hosts) == len(HOSTS) and min(hosts.values()) > 200 / len(HOSTS) / 2


def document(d: int, question: str = "what is it?") -> bytes:
    return chat([{"role": "system", "content": f"document {d}: " + "text " * 2000},
                 {"role": "user", "content": question}])  # fmt: skip


def test_a_burst_of_new_documents_spreads_over_hosts_with_no_prefill_queued():
    by_anchor = router(prefill_tokens_per_s=None)
    docs = [document(d) for d in range(60)]
    home = route(by_anchor, docs[0])
    same_home = [b for b in docs if route(router(prefill_tokens_per_s=None), b) == home][:6]
    assert len(same_home) == 6
    r = router(clock=lambda: 0.0)  # all at one instant: no queue drains
    placed = Counter(route(r, body) for body in same_home)
    assert placed[home] <= 2
    assert len(placed) >= 3


def test_once_queues_drain_new_documents_are_placed_by_their_anchor_alone():
    burst = [document(d) for d in range(12)]
    by_anchor = [route(router(prefill_tokens_per_s=None), b) for b in burst]
    slow = router(clock=TickingClock(step_s=5.0))  # each prefill long done by the next
    assert [route(slow, b) for b in burst] == by_anchor


def test_a_request_behind_its_own_documents_prefill_stays_with_it():
    r = router(clock=lambda: 0.0)
    first = route(r, document(1, "first question"))
    assert route(r, document(1, "second question")) == first


def test_fixed_mode_hashes_the_first_prefix_length_characters_as_sagemaker_does():
    r = router(prefix_match=PrefixMatch.FIXED, prefix_length=1024, balance_factor=None)
    shared = "a" * 1024
    hosts = {route(r, chat([{"role": "user", "content": shared + f"tail {n}" * 50}]))
             for n in range(20)}  # fmt: skip
    assert len(hosts) == 1
    decision = r.route({}, chat([{"role": "user", "content": shared}]))
    assert decision.outcome is Outcome.PLACED
    r.finish(decision)
    assert len(r.index) == 0  # the index is not used
