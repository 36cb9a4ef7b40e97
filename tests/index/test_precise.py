"""The precise view of a host: its engine's confirmed blocks, this router's speculative ones
with their time to live, and the index reading it while the host's stream is live."""

from __future__ import annotations

from extproc.events.mirror import HostMirror
from extproc.events.tokens import CodepointDecoder
from extproc.events.wire import BlockStored
from extproc.index.precise import PreciseHost, SpeculativeBlocks
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.picker.blocks import chain_seed, prompt_blocks

A, B = "127.0.0.1:8000", "127.0.0.2:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def doc(n: int, blocks: int = 8):
    return prompt_blocks(bytes([65 + n]) * 64 * blocks + b"tail", 64, 0)


def index_with_views(clock: Clock, ttl_s: float = 5.0):
    index = PrefixIndex(IndexSizing(64, 10_000, 16 * 1000, 4), clock)
    index.speculative_ttl_s = ttl_s
    views = {}
    for host in (A, B):
        views[host] = PreciseHost(set(), index.speculative_of(host))
        index.set_precise(host, views[host])
    return index, views


def test_a_decision_counts_on_its_host_at_once_and_until_its_ttl():
    clock = Clock()
    index, _ = index_with_views(clock)
    prompt = doc(0)
    index.record(A, index.lookup(prompt, [A, B]))
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 8}
    clock.now += 4.9
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 8}
    clock.now += 0.2
    assert dict(index.lookup(prompt, [A, B]).matched) == {}


def test_confirmed_blocks_outlive_the_ttl_and_are_counted_as_confirmed():
    clock = Clock()
    index, views = index_with_views(clock)
    prompt = doc(1)
    index.record(A, index.lookup(prompt, [A, B]))
    # The engine stored the first 6 blocks (the rest were a partial engine block).
    views[A].confirmed.update(prompt.hashes[:6])  # type: ignore[attr-defined]
    clock.now += 60
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 6}
    index.record(B, index.lookup(doc(2), [A, B]))  # any later record expires A's lazily
    index.record(A, index.lookup(doc(3), [A, B]))
    assert (views[A].stats.confirmed, views[A].stats.unconfirmed) == (6, 2)


def test_what_another_router_sent_is_seen_through_the_events_alone():
    # Two routers, one engine: the second knows the first's prompt only once the
    # engine's events confirm it, and then exactly as far as the engine holds it.
    clock = Clock()
    engine: set[int] = set()
    first, second = (PrefixIndex(IndexSizing(64, 10_000, 16 * 1000, 4), clock) for _ in range(2))
    for index in (first, second):
        index.speculative_ttl_s = 5.0
        index.set_precise(A, PreciseHost(engine, index.speculative_of(A)))
    prompt = doc(4)
    first.record(A, first.lookup(prompt, [A, B]))
    assert dict(second.lookup(prompt, [A, B]).matched) == {}
    engine.update(prompt.hashes[:7])
    assert dict(second.lookup(prompt, [A, B]).matched) == {A: 7}


def test_a_gap_in_what_the_engine_holds_ends_the_match():
    clock = Clock()
    index, views = index_with_views(clock)
    prompt = doc(5)
    held = set(prompt.hashes)
    held.discard(prompt.hashes[3])  # evicted out of prefix order
    views[A].confirmed = held
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 3}


def test_a_silent_host_falls_back_to_what_this_router_recorded():
    clock = Clock()
    index, views = index_with_views(clock, ttl_s=1.0)
    prompt = doc(6)
    index.record(A, index.lookup(prompt, [A, B]))
    clock.now += 30  # long past the TTL, never confirmed
    assert dict(index.lookup(prompt, [A, B]).matched) == {}
    views[A].live = False
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 8}


def test_a_restarted_host_loses_its_speculative_blocks_and_a_gone_host_its_view():
    clock = Clock()
    index, views = index_with_views(clock)
    prompt = doc(7)
    index.record(A, index.lookup(prompt, [A, B]))
    index.forget(A)
    assert len(views[A].speculative) == 0
    index.retain([B])
    assert index.precise(A) is None and index.precise(B) is views[B]


def test_speculative_blocks_are_bounded():
    blocks = SpeculativeBlocks(ttl_s=10.0, max_blocks=5)
    blocks.record(list(range(20)), now=0.0)
    assert len(blocks) == 5
    assert all(blocks.held(b, 1.0) for b in range(15, 20))
    assert blocks.expire(10.0) == list(range(15, 20))


def test_a_decision_made_before_the_hosts_events_are_read_still_counts():
    # The router's first request can come before discovery has subscribed to a host; the
    # view set up a moment later starts from that decision, not from nothing.
    clock = Clock()
    index = PrefixIndex(IndexSizing(64, 10_000, 16 * 1000, 4), clock)
    index.speculative_ttl_s = 5.0
    prompt = doc(8)
    index.record(A, index.lookup(prompt, [A, B]))
    index.set_precise(A, PreciseHost(set(), index.speculative_of(A)))
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 8}


def test_an_eviction_after_the_engine_confirmed_a_decision_counts_at_once():
    clock = Clock()
    index, views = index_with_views(clock, ttl_s=10.0)
    prompt = doc(4)
    index.record(A, index.lookup(prompt, [A, B]))
    confirmed = views[A].confirmed
    confirmed.update(prompt.hashes)  # type: ignore[attr-defined]
    views[A].confirm(prompt.hashes)  # the BlockStored events
    assert len(views[A].speculative) == 0 and views[A].stats.confirmed == 8
    clock.now += 1
    # The engine evicts the prompt's last four blocks a second later (BlockRemoved): the
    # router knows at once, not when the decision's speculation would have run out.
    confirmed.difference_update(prompt.hashes[4:])  # type: ignore[attr-defined]
    assert dict(index.lookup(prompt, [A, B]).matched) == {A: 4}


def test_a_decision_for_blocks_the_engine_holds_is_no_speculation():
    clock = Clock()
    index, views = index_with_views(clock, ttl_s=10.0)
    prompt = doc(5)
    confirmed = views[A].confirmed
    confirmed.update(prompt.hashes[:6])  # type: ignore[attr-defined]
    index.record(A, index.lookup(prompt, [A, B]))
    # Only the two blocks the engine lacks wait for their events.
    assert len(views[A].speculative) == 2 and views[A].stats.recorded == 2
    confirmed.difference_update(prompt.hashes[:6])  # type: ignore[attr-defined]
    assert dict(index.lookup(prompt, [A, B]).matched) == {}


def test_the_engine_holds_the_start_of_the_block_a_match_stops_in():
    # Engine blocks of 16 characters, router blocks of 64: the engine holds 560 bytes of
    # the prompt, 8 router blocks and 48 bytes of the ninth.
    text = "".join(chr(65 + i % 26) for i in range(600)).encode()
    mirror = HostMirror(64, CodepointDecoder(), chain_seed, 10_000)
    mirror.stored(
        BlockStored(
            block_hashes=list(range(1, 36)),
            parent_block_hash=None,
            token_ids=list(text[:560]),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=None,
        )
    )
    index = PrefixIndex(IndexSizing(64, 10_000, 16 * 1000, 4), Clock())
    view = PreciseHost(mirror, index.speculative_of(A))
    index.set_precise(A, view)
    prompt = prompt_blocks(text, 64, 0)
    depth = index.lookup(prompt, [A, B]).depth_on(A)
    assert depth == 8
    assert index.tail_bytes(A, prompt, depth) == 48
    # A prompt that leaves the engine's text inside the ninth block: none of it (where in
    # its engine blocks is not known).
    other = prompt_blocks(text[:522] + b"?" * 78, 64, 0)
    assert index.tail_bytes(A, other, 8) == 0
    assert index.tail_bytes(B, prompt, 0) == 0  # approximate: whole blocks only
    view.live = False  # a silent stream: the approximate blocks again
    assert index.tail_bytes(A, prompt, depth) == 0
