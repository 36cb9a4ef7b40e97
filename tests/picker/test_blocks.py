"""Chained block hashes and anchors of the canonical prompt."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.picker.blocks import chain_seed, prompt_blocks
from extproc.picker.keys import KeyMode, extract_key

BLOCK = 64

text = st.text(min_size=0, max_size=400)
turns = st.lists(st.tuples(text, text), min_size=1, max_size=5)


def key_of(body: dict, limit: int = 65536):
    return extract_key(json.dumps(body).encode(), {}, KeyMode.OPENAI, limit)


def blocks_of(body: dict, block: int = BLOCK):
    key = key_of(body)
    return prompt_blocks(key.key, block, chain_seed(key.model, key.salt), key.segments)


def conversation(system: str, pairs: list[tuple[str, str]], upto: int) -> dict:
    messages = [{"role": "system", "content": system}]
    for user, assistant in pairs[:upto]:
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": assistant})
    messages.append({"role": "user", "content": pairs[upto][0] if upto < len(pairs) else "?"})
    return {"model": "m", "messages": messages}


@given(text, turns)
def test_turn_k_plus_1_shares_every_full_block_of_turn_k(system, pairs):
    for k in range(len(pairs)):
        earlier = blocks_of(conversation(system, pairs, k))
        later = blocks_of(conversation(system, pairs, k + 1))
        # Turn k ends with its user message; turn k+1 continues it with the reply.
        assert later.key.startswith(earlier.key)
        assert later.hashes[: earlier.depth] == earlier.hashes


@given(st.binary(max_size=2000), st.integers(min_value=1, max_value=300))
def test_a_hash_names_its_whole_prefix_and_boundaries_ignore_what_follows(data, extra):
    whole = prompt_blocks(data + b"x" * extra, BLOCK, 0)
    cut = prompt_blocks(data, BLOCK, 0)
    assert whole.hashes[: cut.depth] == cut.hashes
    assert cut.depth == len(data) // BLOCK
    # Changing one byte changes that block's hash and every later one, never an earlier one.
    if len(data) >= 2 * BLOCK:
        flipped = bytearray(data)
        flipped[BLOCK] ^= 1
        other = prompt_blocks(bytes(flipped), BLOCK, 0)
        assert other.hashes[0] == cut.hashes[0]
        assert all(a != b for a, b in zip(other.hashes[1:], cut.hashes[1:], strict=True))


def test_the_seed_separates_models_and_tenants():
    data = b"a shared system prompt " * 20
    seeds = {chain_seed(m, s) for m in (None, "base", "lora-a") for s in (None, "t1", "t2")}
    assert len(seeds) == 9
    hashes = {prompt_blocks(data, BLOCK, seed).hashes[0] for seed in seeds}
    assert len(hashes) == 9
    assert chain_seed("a", "b") != chain_seed("a\x00b", None)


chat_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text}),
    min_size=1,
    max_size=4,
)


@given(chat_messages, st.integers(min_value=0, max_value=4), st.booleans())
def test_whitespace_and_key_order_do_not_change_the_hashes(messages, indent, reverse):
    body = {"model": "m", "messages": messages, "temperature": 0.1}
    compact = json.dumps(body, separators=(",", ":")).encode()
    reordered = dict(reversed(list(body.items())))
    if reverse:
        reordered["messages"] = [dict(reversed(list(m.items()))) for m in messages]
    spaced = json.dumps(reordered, indent=indent, ensure_ascii=reverse).encode()
    a, b = (extract_key(raw, {}, KeyMode.OPENAI, 65536) for raw in (compact, spaced))
    assert prompt_blocks(a.key, BLOCK, chain_seed(a.model, a.salt), a.segments) == prompt_blocks(
        b.key, BLOCK, chain_seed(b.model, b.salt), b.segments
    )


def test_segments_mark_message_ends_in_bytes():
    key = key_of(
        {"messages": [{"role": "system", "content": "é" * 10}, {"role": "user", "content": "q"}]}
    )
    assert key.segments == (len(b"system\n") + 20 + 1, len(key.key))
    assert key_of({"prompt": "one piece"}).segments == ()


def test_the_anchor_of_a_document_is_its_first_block_past_a_shared_preamble():
    preamble = "p" * (4 * BLOCK)
    anchors = set()
    for question in range(5):
        body = {"messages": [{"role": "system", "content": preamble + "document seven " * 30},
                             {"role": "user", "content": f"question {question}"}]}  # fmt: skip
        blocks = blocks_of(body)
        anchors.add(blocks.anchor(4))
        assert blocks.anchor(4) == blocks.hashes[4]
    assert len(anchors) == 1


def test_a_conversation_keeps_its_anchor_as_it_grows_past_a_shared_system_prompt():
    system = "s" * (BLOCK + BLOCK // 2)  # one full block shared, then half a block more
    pairs = [("first question, short", "reply " * 40), ("second", "reply " * 5), ("third", "")]
    anchors = {blocks_of(conversation(system, pairs, k)).anchor(1) for k in range(3)}
    assert len(anchors) == 1
    other = [("another first question", "reply")]
    assert blocks_of(conversation(system, other, 0)).anchor(1) not in anchors


def test_an_unpopular_prompt_is_anchored_by_its_first_block():
    blocks = prompt_blocks(b"x" * (3 * BLOCK), BLOCK, 5)
    assert blocks.anchor(0) == blocks.hashes[0]
    # Shorter than a block: the whole prompt, seeded by the chain.
    short = prompt_blocks(b"tiny", BLOCK, 5)
    assert short.anchor(0) != prompt_blocks(b"tinier", BLOCK, 5).anchor(0)
    assert short.anchor(0) != prompt_blocks(b"tiny", BLOCK, 6).anchor(0)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.text(max_size=900), max_size=6),
    block=st.sampled_from([64, 128, 512]),
)
def test_anchors_in_one_pass_equal_each_anchor(parts, block):
    key = b""
    segments = []
    for part in parts:
        key += part.encode("utf-8", "surrogatepass")
        segments.append(len(key))
    blocks = prompt_blocks(key, block, 7, tuple(segments))
    assert blocks.anchors() == [blocks.anchor(d) for d in range(blocks.depth + 1)]
