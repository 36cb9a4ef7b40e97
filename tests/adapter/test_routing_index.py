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
    # Spread by their own blocks: each host's count is binomial, mean 66.7, sd 6.7 over
    # 200 requests; half the mean (33) is 5 sd below. Pulled to the system prompt's home,
    # the others would get none.
    assert len(hosts) == len(HOSTS) and min(hosts.values()) > 200 / len(HOSTS) / 2


def first_turns(system: str, conversations: int) -> list[bytes]:
    """First turns of new chats after one system prompt, each a few hundred characters, so
    each reaches a block of its own past the system prompt, as real first turns do."""
    return [
        chat(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"chat {c}, turn 0: " + f"question {c} " * 40},
            ]
        )
        for c in range(conversations)
    ]


def test_new_chats_after_a_shared_system_prompt_spread_from_the_second_one_on():
    # Six new chats sent one at a time to a router that has just started (the issue's
    # case: 5 of 6 went to one of 3 instances). The first lands by its system prompt's
    # anchor; from the second on, each branches off the system prompt, which is then
    # taken as shared, and lands by its own anchor (idle: no cache pressure to weigh).
    # So the 5 later chats are spread as their hashes fall, uniformly over the 4 hosts,
    # and a trial fails (a host holds 4 or more of the 6, so another holds none) when the
    # first one's host gets 3 or more of the 5 (binomial, p = 1/4: 0.104) or another
    # host gets 4 or more of them (3 x 0.016): 0.15 of trials. 200 trials: mean 30,
    # standard deviation 5; the bound is 3 deviations above (measured: 34). Before
    # branches were known, the system prompt's host took the first three chats of every
    # trial (its count grew hot at the 4th): 113 of the 200 trials failed.
    failed = 0
    trials = 200
    for trial in range(trials):
        r = router()
        system = f"You are assistant {trial}. " + "Answer with care and cite sources. " * 32
        hosts = Counter(route(r, body) for body in first_turns(system, 6))
        failed += max(hosts.values()) >= 4
    assert failed <= 45, failed


def test_a_chat_whose_first_turn_ends_inside_the_system_prompts_last_block_stays_home():
    # No block of its own past the system prompt: as a document's short question, it is
    # no branch, and goes where the system prompt is held.
    r = router()
    system = "Answer with care and cite sources. " * 32
    bodies = [
        chat([{"role": "system", "content": system}, {"role": "user", "content": f"hi {c}"}])
        for c in range(3)
    ]
    assert len({route(r, body) for body in bodies}) == 1


def test_the_next_turn_of_a_chat_is_no_branch_and_follows_it():
    r = router()
    system = "Answer with care and cite sources. " * 32
    homes = {}
    histories = {}
    for c, body in enumerate(first_turns(system, 6)):
        homes[c] = route(r, body)
        histories[c] = [*json.loads(body)["messages"], {"role": "assistant", "content": "ok " * 50}]
    for c, history in histories.items():
        history.append({"role": "user", "content": f"and then {c}? " * 40})
        assert route(r, chat(history)) == homes[c]


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
