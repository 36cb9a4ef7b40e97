"""One host's LRU of blocks: prefix-closed, bounded, and matched by binary search."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.index.hosts import HostBlocks
from extproc.picker.blocks import prompt_blocks

# A few documents, each a chain of up to 12 blocks; prompts are prefixes of them.
chains = [prompt_blocks(bytes([d]) * 64 * 12, 64, d).hashes for d in range(6)]
prompts = st.tuples(st.integers(0, 5), st.integers(1, 12)).map(lambda t: chains[t[0]][: t[1]])


def linear_depth(held: HostBlocks, hashes) -> int:
    depth = 0
    for block in hashes:
        if block not in held:
            break
        depth += 1
    return depth


@given(st.lists(prompts, max_size=60), st.integers(1, 40))
@settings(max_examples=300)
def test_binary_search_matches_a_walk_and_the_set_stays_prefix_closed(sequence, capacity):
    held = HostBlocks(capacity)
    for hashes in sequence:
        depth = held.matched_depth(hashes)
        assert depth == linear_depth(held, hashes)
        held.touch(hashes, depth)
        assert len(held) <= capacity
        for chain in chains:
            present = [block in held for block in chain]
            # Prefix-closed: once a block is missing, every deeper one is too.
            assert present == sorted(present, reverse=True)


def test_eviction_takes_the_least_recent_prompt_deepest_blocks_first():
    held = HostBlocks(10)
    held.touch(chains[0][:6], 0)
    held.touch(chains[1][:6], 0)  # 12 blocks for 10 slots: chain 0 loses its last two
    assert held.matched_depth(chains[0]) == 4
    assert held.matched_depth(chains[1]) == 6
    held.touch(chains[0][:4], 4)  # chain 0 is now the most recent
    held.touch(chains[2][:3], 0)
    assert held.matched_depth(chains[0]) == 4
    assert held.matched_depth(chains[1]) == 3


def test_an_overstated_held_count_is_repaired_not_fatal():
    held = HostBlocks(20)
    held.touch(chains[3][:5], 5)  # claims five already there; none were
    assert held.matched_depth(chains[3]) == 5


def test_shrink_evicts_down_to_the_new_capacity():
    held = HostBlocks(50)
    held.touch(chains[4], 0)
    assert held.shrink(5) == 7
    assert len(held) == 5 and held.capacity == 5
    assert held.matched_depth(chains[4]) == 5
