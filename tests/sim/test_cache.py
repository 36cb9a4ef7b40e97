import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.sim.cache import CacheResult, PrefixCache

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def blocks(*letters: str) -> str:
    """A text made of whole default-size blocks, one letter repeated per block."""
    return "".join(letter * BLOCK_CHARS for letter in letters)


def char_cache(capacity: int) -> PrefixCache:
    """One character per token and one token per block: each character is a block."""
    return PrefixCache(capacity, block_size_tokens=1, chars_per_token=1)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"capacity_blocks": 0}, "capacity_blocks"),
        ({"capacity_blocks": -3}, "capacity_blocks"),
        ({"capacity_blocks": True}, "capacity_blocks"),
        ({"capacity_blocks": 1.5}, "capacity_blocks"),
        ({"capacity_blocks": 8, "block_size_tokens": 0}, "block_size_tokens"),
        ({"capacity_blocks": 8, "chars_per_token": 0}, "chars_per_token"),
    ],
)
def test_rejects_non_positive_arguments_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PrefixCache(**kwargs)


def test_query_tokens_round_a_partial_token_up() -> None:
    cache = PrefixCache(8)
    assert cache.lookup_and_insert("abcde").query_tokens == 2
    assert cache.lookup_and_insert("").query_tokens == 0
    assert cache.lookup_and_insert("abcd").query_tokens == 1


def test_first_sight_misses_and_repeat_hits_whole_blocks_only() -> None:
    cache = PrefixCache(64)
    text = blocks("a", "b") + "c" * (BLOCK_CHARS // 2)  # two and a half blocks

    assert cache.lookup_and_insert(text) == CacheResult(query_tokens=40, hit_tokens=0)
    # The trailing half block is never cached, so only two blocks can hit.
    assert cache.lookup_and_insert(text) == CacheResult(query_tokens=40, hit_tokens=32)
    assert len(cache) == cache.blocks_used == 2


def test_prompt_shorter_than_a_block_never_hits() -> None:
    cache = PrefixCache(64)
    cache.lookup_and_insert("short")
    assert cache.lookup_and_insert("short").hit_tokens == 0
    assert cache.blocks_used == 0


def test_shared_prefix_hits_up_to_the_first_differing_block() -> None:
    cache = PrefixCache(64)
    cache.lookup_and_insert(blocks("s", "y", "s", "x"))
    result = cache.lookup_and_insert(blocks("s", "y", "s", "q", "r"))
    assert result.hit_tokens == 3 * BLOCK_TOKENS


def test_a_differing_first_block_misses_everything_after_it() -> None:
    cache = PrefixCache(64)
    cache.lookup_and_insert(blocks("a", "b", "c"))
    # Blocks two and three have the same text as before, but a new prefix.
    assert cache.lookup_and_insert(blocks("z", "b", "c")).hit_tokens == 0


def test_same_block_text_at_another_position_does_not_match() -> None:
    cache = PrefixCache(64)
    cache.lookup_and_insert(blocks("a", "a"))
    # Block "a" at position two hangs off block "a", not off block "b".
    assert cache.lookup_and_insert(blocks("b", "a")).hit_tokens == 0


def test_evicts_least_recently_used_blocks_at_capacity() -> None:
    cache = char_cache(capacity=4)
    cache.lookup_and_insert("ab")
    cache.lookup_and_insert("cd")
    assert cache.lookup_and_insert("ab").hit_tokens == 2  # "ab" is now newer than "cd"

    cache.lookup_and_insert("ef")  # needs two blocks: "cd" must go

    assert cache.blocks_used == 4
    assert cache.lookup_and_insert("ab").hit_tokens == 2
    assert cache.lookup_and_insert("cd").hit_tokens == 0


def test_eviction_takes_a_prompts_deepest_blocks_first() -> None:
    cache = char_cache(capacity=3)
    cache.lookup_and_insert("abc")
    cache.lookup_and_insert("x")  # evicts one block of "abc": its tail
    assert cache.lookup_and_insert("abc").hit_tokens == 2


def test_prompt_longer_than_capacity_keeps_its_leading_blocks() -> None:
    cache = char_cache(capacity=2)
    cache.lookup_and_insert("abcd")
    assert cache.blocks_used == 2
    assert cache.lookup_and_insert("abcd").hit_tokens == 2


def test_kv_usage_inputs_are_exposed() -> None:
    cache = PrefixCache(10)
    cache.lookup_and_insert(blocks("a", "b", "c"))
    assert (cache.blocks_used, cache.capacity_blocks) == (3, 10)


def test_lone_surrogates_from_json_are_hashable() -> None:
    cache = char_cache(capacity=8)
    cache.lookup_and_insert("\ud800x")
    assert cache.lookup_and_insert("\ud800x").hit_tokens == 2


cache_shapes = st.tuples(
    st.integers(min_value=1, max_value=64),  # capacity_blocks
    st.integers(min_value=1, max_value=8),  # block_size_tokens
    st.integers(min_value=1, max_value=4),  # chars_per_token
)
# A small alphabet makes shared prefixes, and so hits, common.
prompts = st.text(alphabet="ab", max_size=200)


@settings(max_examples=200, deadline=None)
@given(shape=cache_shapes, texts=st.lists(prompts, max_size=20))
def test_hits_are_whole_blocks_within_the_prompt_and_capacity_holds(
    shape: tuple[int, int, int], texts: list[str]
) -> None:
    capacity, block_tokens, chars_per_token = shape
    cache = PrefixCache(capacity, block_tokens, chars_per_token)
    for text in texts:
        result = cache.lookup_and_insert(text)
        assert 0 <= result.hit_tokens <= result.query_tokens
        assert result.hit_tokens % block_tokens == 0
        assert cache.blocks_used <= capacity


@settings(max_examples=200, deadline=None)
@given(shape=cache_shapes, history=st.lists(prompts, max_size=10), text=prompts)
def test_repeated_prompt_hits_all_its_full_blocks_when_they_fit(
    shape: tuple[int, int, int], history: list[str], text: str
) -> None:
    capacity, block_tokens, chars_per_token = shape
    cache = PrefixCache(capacity, block_tokens, chars_per_token)
    for earlier in history:
        cache.lookup_and_insert(earlier)
    full_blocks = len(text) // (block_tokens * chars_per_token)

    cache.lookup_and_insert(text)
    again = cache.lookup_and_insert(text)

    expected_blocks = min(full_blocks, capacity)
    assert again.hit_tokens == expected_blocks * block_tokens


def test_held_blocks_survive_pressure_and_a_full_cache_refuses_more() -> None:
    cache = char_cache(capacity=4)
    held = cache.block_hashes("ab")
    assert cache.acquire(held, private_blocks=1)
    cache.lookup_and_insert("x")  # fills the cache: 2 held + 1 private + 1 evictable
    assert cache.blocks_used == 4

    # Two more held blocks would need room that only held blocks occupy.
    assert not cache.acquire(cache.block_hashes("cd"), private_blocks=0)
    assert cache.blocks_referenced == 3
    # One more fits by evicting the unreferenced "x".
    assert cache.acquire(cache.block_hashes("c"), private_blocks=0)
    assert cache.cached_prefix_blocks(cache.block_hashes("x")) == 0
    assert cache.cached_prefix_blocks(held) == 2


def test_released_blocks_stay_cached_until_evicted_head_last() -> None:
    cache = char_cache(capacity=3)
    hashes = cache.block_hashes("abc")
    assert cache.acquire(hashes, private_blocks=0)
    cache.release(hashes, private_blocks=0)
    assert (cache.blocks_used, cache.blocks_referenced) == (3, 0)
    assert cache.lookup_and_insert("abc").hit_tokens == 3
    assert cache.acquire(cache.block_hashes("z"), private_blocks=0)
    assert cache.lookup_and_insert("abc").hit_tokens == 2  # the tail went first


def test_shared_blocks_are_held_once_and_freed_by_the_last_holder() -> None:
    cache = char_cache(capacity=8)
    hashes = cache.block_hashes("ab")
    assert cache.acquire(hashes, private_blocks=1)
    assert cache.acquire(hashes, private_blocks=1)
    assert cache.blocks_referenced == 4
    cache.release(hashes, private_blocks=1)
    assert cache.clear_unreferenced() == 0  # still held by the other request
    cache.release(hashes, private_blocks=1)
    assert cache.blocks_referenced == 0
    assert cache.clear_unreferenced() == 2
    assert cache.blocks_used == 0


def test_reset_keeps_held_blocks_and_forgets_the_rest() -> None:
    cache = char_cache(capacity=8)
    cache.lookup_and_insert("xyz")
    held = cache.block_hashes("ab")
    assert cache.acquire(held, private_blocks=0)
    assert cache.clear_unreferenced() == 3
    assert cache.lookup_and_insert("xyz").hit_tokens == 0
    assert cache.cached_prefix_blocks(held) == 2


@settings(max_examples=200, deadline=None)
@given(shape=cache_shapes, texts=st.lists(prompts, max_size=30))
def test_touch_is_a_lookup_then_an_insert(shape: tuple[int, int, int], texts: list[str]) -> None:
    # The fast path (a binary search over a prefix-closed cache, new blocks appended in one
    # call) must count and order exactly as the block-by-block walk does.
    fast, walked = PrefixCache(*shape), PrefixCache(*shape)
    for text in texts:
        hashes = fast.block_hashes(text)
        expected = walked.cached_prefix_blocks(hashes)
        walked.insert(hashes)
        assert fast.touch(hashes) == expected
        assert list(fast._evictable) == list(walked._evictable)
