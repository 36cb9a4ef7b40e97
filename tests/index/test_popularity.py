"""Prefix popularity: bounded windows, monotone depth, and how hot a prompt is."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.index.popularity import MIN_HOT_REQUESTS, PrefixPopularity, heat_of
from extproc.picker.blocks import prompt_blocks

PREAMBLE = b"p" * 64 * 4


def blocks_of(n: int, question: int = 0):
    return prompt_blocks(PREAMBLE + bytes([n % 250 + 1]) * 64 * 6 + b"q%d" % question, 64, 0)


def document(n: int):
    return blocks_of(n).hashes


@given(st.lists(st.integers(0, 9), min_size=1, max_size=200), st.integers(1, 50))
def test_popular_depth_is_the_longest_prefix_at_the_count(docs, min_count):
    popularity = PrefixPopularity(window_requests=64)
    for n in docs:
        popularity.observe(document(n))
    for n in range(10):
        hashes = document(n)
        depth = popularity.popular_depth(hashes, min_count)
        assert all(popularity.count(h) >= min_count for h in hashes[:depth])
        assert depth == len(hashes) or popularity.count(hashes[depth]) < min_count


def test_windows_bound_memory_and_forget_old_traffic():
    popularity = PrefixPopularity(window_requests=10, max_keys=1000)
    for _ in range(10):
        popularity.observe(document(0))
    for n in range(20):
        popularity.observe(document(n + 1))
    assert popularity.count(document(0)[-1]) == 0  # two windows later, gone
    assert popularity.requests == 10  # the last full window; the current one is empty
    small = PrefixPopularity(window_requests=10_000, max_keys=25)
    for n in range(100):
        small.observe(document(n))
        assert len(small) <= 2 * 25 + 10  # one request's blocks over the bound at most


def test_a_shared_preamble_is_hot_on_every_host_and_a_cold_document_is_not():
    popularity = PrefixPopularity()
    for n in range(70):
        popularity.observe(blocks_of(n % 35, n).counted)
    heat = heat_of(popularity, blocks_of(3), hosts=7, hot_factor=1.0)
    assert heat.depth == 4  # the preamble's blocks, not the document's
    assert heat.replicas == 7 and not heat.repeated


def test_a_hot_document_is_spread_in_proportion_to_its_share():
    popularity = PrefixPopularity()
    for n in range(100):
        # Document 0, each time with another question: half the traffic.
        popularity.observe(blocks_of(0 if n % 2 else n, n).counted)
    heat = heat_of(popularity, blocks_of(0, 1000), hosts=7, hot_factor=1.0)
    assert heat.depth == len(document(0))
    assert heat.replicas == 4  # 50% of 7 hosts' traffic: 3.5 hosts' fair share
    assert not heat.repeated
    assert heat_of(popularity, blocks_of(0, 1000), hosts=7, hot_factor=2.0).replicas == 2


def test_one_prompt_repeated_as_it_is_is_told_from_a_hot_prefix():
    popularity = PrefixPopularity()
    for n in range(40):
        popularity.observe(blocks_of(0 if n % 2 else n, 0 if n % 2 else n).counted)
    heat = heat_of(popularity, blocks_of(0, 0), hosts=7, hot_factor=1.0)
    assert heat.repeated and heat.depth == len(document(0))


def test_nothing_is_hot_before_enough_requests_or_on_one_host():
    popularity = PrefixPopularity()
    for n in range(MIN_HOT_REQUESTS - 1):
        popularity.observe(blocks_of(0, n).counted)
    assert heat_of(popularity, blocks_of(0), hosts=3, hot_factor=1.0).depth == 0
    # A prefix every request carries is hot after a handful of them: more than a fair
    # share by two standard deviations.
    seen = MIN_HOT_REQUESTS - 1
    while heat_of(popularity, blocks_of(0), hosts=3, hot_factor=1.0).depth == 0:
        popularity.observe(blocks_of(0, 100 + seen).counted)
        seen += 1
    assert seen <= 6
    assert heat_of(popularity, blocks_of(0), hosts=1, hot_factor=1.0).depth == 0


def test_a_fair_share_by_chance_is_not_hot():
    popularity = PrefixPopularity()
    # A conversation that sent 3 of the first 9 requests, on 3 hosts: its fair share.
    for n in range(9):
        popularity.observe(blocks_of(0 if n % 3 == 0 else n, n).counted)
    # Only the preamble every document shares is hot, not the conversation's own blocks.
    assert heat_of(popularity, blocks_of(0, 50), hosts=3, hot_factor=1.0).depth == 4


def test_a_hot_document_after_a_shared_preamble_knows_what_it_continues():
    popularity = PrefixPopularity()
    for n in range(120):
        # Every request carries the preamble; a third of them document 0.
        popularity.observe(blocks_of(0 if n % 3 == 0 else n, n).counted)
    heat = heat_of(popularity, blocks_of(0, 999), hosts=7, hot_factor=1.0)
    assert heat.depth == len(document(0)) and heat.replicas == 3
    assert heat.parent_depth == 4  # the preamble: where document 0 lived while cold


def test_a_new_prompt_branching_off_a_shared_prefix_takes_it_as_shared_at_once():
    popularity = PrefixPopularity()
    popularity.observe_prompt(blocks_of(0))
    # The second document after the preamble: the preamble was carried on past by the
    # first, so this one branches off it, long before a count could be hot.
    heat = heat_of(popularity, blocks_of(1), hosts=3, hot_factor=1.0)
    assert heat.depth == 4 and heat.replicas == 3 and not heat.repeated
    assert popularity.branch_depth(blocks_of(1).hashes) == 4


def test_a_prompt_that_goes_on_where_an_earlier_one_ended_is_no_branch():
    popularity = PrefixPopularity()
    first = blocks_of(0)
    popularity.observe_prompt(first)
    # The next turn: the whole earlier prompt and more. Nobody went on past its last
    # block before, so it continues that prompt; it does not branch off a shared one.
    following = prompt_blocks(first.key + b"r" * 64 * 3, 64, 0)
    assert popularity.branch_depth(following.hashes) == 0
    assert heat_of(popularity, following, hosts=3, hot_factor=1.0).depth == 0
    # Another question on the same document, inside its last partial block: no block of
    # its own past what was seen, so no branch either.
    assert heat_of(popularity, blocks_of(0, 7), hosts=3, hot_factor=1.0).depth == 0


def test_a_branch_of_a_small_share_of_the_traffic_stays_with_its_holder():
    popularity = PrefixPopularity()
    own = b"o" * 64 * 4
    popularity.observe_prompt(prompt_blocks(own + b"a" * 64 * 2, 64, 0))
    for n in range(40):
        popularity.observe_prompt(blocks_of(n))
    branching = prompt_blocks(own + b"b" * 64 * 2, 64, 0)
    assert popularity.branch_depth(branching.hashes) == 4
    # 1 of 41 requests: less than one host's share, so nothing to spread.
    assert heat_of(popularity, branching, hosts=3, hot_factor=1.0).depth == 0
