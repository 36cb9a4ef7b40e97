"""The prefix index: lookups, sizing from the engines' caches, the memory bound, forgetting."""

from __future__ import annotations

from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.picker.blocks import prompt_blocks

A, B, C = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"


def sizing(max_blocks: int = 1000, default_tokens: int = 16 * 100) -> IndexSizing:
    # 64-byte blocks at 4 characters a token: 16 tokens a block.
    return IndexSizing(
        block_bytes=64, max_blocks=max_blocks, default_host_tokens=default_tokens, chars_per_token=4
    )


def doc(n: int, blocks: int = 10):
    return prompt_blocks(bytes([65 + n]) * 64 * blocks + b"tail", 64, 0)


def test_lookup_reports_the_matched_depth_on_each_host_that_holds_any():
    index = PrefixIndex(sizing())
    first = doc(0)
    index.record(A, index.lookup(first, [A, B, C]))
    half = prompt_blocks(first.key[: 64 * 5], 64, 0)
    index.record(B, index.lookup(half, [A, B, C]))
    lookup = index.lookup(first, [A, B, C])
    assert dict(lookup.matched) == {A: 10, B: 5}
    assert lookup.depth_on(C) == 0
    # Only the hosts asked about are looked at.
    assert dict(index.lookup(first, [B]).matched) == {B: 5}


def test_each_host_is_sized_like_its_engine_cache():
    index = PrefixIndex(sizing())
    index.set_cache_sizes({A: 16 * 20, B: 0})  # B: unknown, the default
    assert index.capacity_of(A) == 20
    assert index.capacity_of(B) == 100
    for n in range(5):
        index.record(A, index.lookup(doc(n), [A]))
    assert index.host_sizes()[A] == 20
    assert index.evicted["capacity"] == 30
    # The two most recent documents survive whole: the engine would have kept those.
    assert index.lookup(doc(4), [A]).depth_on(A) == 10
    assert index.lookup(doc(3), [A]).depth_on(A) == 10
    assert index.lookup(doc(0), [A]).depth_on(A) == 0


def test_the_memory_bound_scales_every_host_down_alike():
    index = PrefixIndex(sizing(max_blocks=120))
    index.set_cache_sizes({A: 16 * 100, B: 16 * 100, C: 16 * 200})
    assert [index.capacity_of(h) for h in (A, B, C)] == [30, 30, 60]
    for n in range(20):
        for host in (A, B, C):
            index.record(host, index.lookup(doc(n), [host]))
    assert len(index) <= 120


def test_hosts_that_leave_or_reset_lose_their_entries():
    index = PrefixIndex(sizing())
    for host in (A, B, C):
        index.record(host, index.lookup(doc(1), [host]))
    index.retain([A, B])
    assert index.evicted["host_left"] == 10
    assert C not in index.host_sizes()
    index.forget(B)
    assert index.evicted["host_reset"] == 10
    assert dict(index.lookup(doc(1), [A, B, C]).matched) == {A: 10}
    index.clear()
    assert len(index) == 0


def test_a_prompt_shorter_than_a_block_matches_and_records_nothing():
    index = PrefixIndex(sizing())
    short = prompt_blocks(b"hi", 64, 0)
    index.record(A, index.lookup(short, [A]))
    assert len(index) == 0 and index.lookup(short, [A]).matched == {}


def test_a_siblings_hashes_are_recorded_as_a_decision_of_its_own_and_not_passed_on():
    own, sibling = PrefixIndex(sizing()), PrefixIndex(sizing())
    told: list[tuple[str, tuple[int, ...]]] = []
    own.on_record = lambda host, hashes: told.append((host, tuple(hashes)))
    sibling.on_record = lambda host, hashes: told.append(("echo", tuple(hashes)))
    first = doc(0)
    own.record(A, own.lookup(first, [A, B]))
    assert told == [(A, first.hashes)]
    sibling.record_hashes(A, told[0][1])
    assert told == [(A, first.hashes)]  # a sibling's decision travels once
    assert own.lookup(first, [A, B]).matched == sibling.lookup(first, [A, B]).matched
    assert sibling.lookup(first, [A, B]).depth_on(A) == 10
    # Half of it again, then all of it: the host's LRU keeps a prompt's first blocks the
    # newest, so what survives eviction is still a prefix.
    sibling.record_hashes(B, first.hashes[:5])
    sibling.record_hashes(B, first.hashes)
    assert sibling.lookup(first, [B]).depth_on(B) == 10
    sibling.record_hashes(C, ())
    assert C not in sibling.host_sizes()


def test_a_siblings_hashes_are_speculative_where_the_hosts_events_are_read():
    now = [100.0]
    index = PrefixIndex(sizing(), clock=lambda: now[0])
    index.speculative_ttl_s = 2.0
    first = doc(0)
    index.record_hashes(A, first.hashes)
    assert len(index.speculative_of(A)) == 10
    assert index.speculative_of(A).held(first.hashes[0], now[0] + 1.9)
    assert not index.speculative_of(A).held(first.hashes[0], now[0] + 2.1)
