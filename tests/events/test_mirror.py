"""The mirror holds exactly the router's block hashes of what the engine stored.

Chat bodies are rendered as vLLM renders them (the ChatML template of
tests/vllm/make_tiny_model.py, generation prompt included), tokenized with a real
byte-level BPE tokenizer (special tokens recognised), cut into engine blocks (the partial
last one dropped, as vLLM stores only full blocks) and fed as ``BlockStored`` events. The
router's hashes come from the router's own code: ``extract_key`` and ``prompt_blocks``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from extproc.events.mirror import HostMirror
from extproc.events.tokens import CodepointDecoder, TokenDecoder, VocabDecoder
from extproc.events.wire import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from extproc.picker.blocks import chain_seed, prompt_blocks
from extproc.picker.keys import KeyMode, extract_key
from extproc.sim.prompt import prompt_text

from .test_tokens import tokenizer_json, write_tokenizer

MODEL = "tiny"
BLOCK_BYTES = 512
ENGINE_BLOCK = 128
GENERATION_PROMPT = b"assistant\n"

WORDS = ("the", "document", "says", "alpha", "beta", "gamma,", "and", "then", "delta:", "42")


def prose(seed: int, length: int, extra: str = "") -> str:
    """Deterministic text of about ``length`` characters."""
    words = [WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(length // 5)]
    return " ".join(words) + extra


BODIES: list[dict[str, Any]] = [
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You answer from the document. " + prose(1, 3000)},
            {"role": "user", "content": "What does it say about alpha?"},
        ],
    },
    {  # multi-turn, with the assistant's reply
        "model": MODEL,
        "messages": [
            {"role": "system", "content": prose(2, 800)},
            {"role": "user", "content": prose(3, 900)},
            {"role": "assistant", "content": prose(4, 1200)},
            {"role": "user", "content": prose(5, 700) + " and?"},
        ],
    },
    {  # beyond ASCII
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Réponds en français. 中文字符 " * 60},
            {"role": "user", "content": "😀🎉 émoji ∑ ŝ 漢字 " * 80 + prose(6, 500)},
        ],
    },
    {  # multi-part content, non-text parts skipped by both sides
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": prose(7, 1500)},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "naïve café " * 90},
                ],
            },
        ],
    },
]


def chatml(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """make_tiny_model.CHATML, as Jinja renders it."""
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(p["text"] for p in content if p["type"] == "text")
        out.append(f"<|im_start|>{message['role']}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def router_key(body: dict[str, Any]) -> bytes:
    return extract_key(json.dumps(body).encode(), {}, KeyMode.OPENAI, 65536).key


def engine_hash(
    parent: BlockHash | None, tokens: Sequence[int], extra: object, kind: str
) -> BlockHash:
    """Content-addressed, as vLLM's are: equal prefixes share engine hashes."""
    digest = hashlib.sha256(repr((parent, tuple(tokens), extra)).encode()).digest()
    return int.from_bytes(digest[:8], "big") if kind == "int" else digest


def engine_events(
    tokens: Sequence[int],
    block_size: int,
    splits: Sequence[int] = (),
    salt: str | None = None,
    lora: str | None = None,
    kind: str = "bytes",
) -> list[BlockStored]:
    """The ``BlockStored`` events of the full blocks of ``tokens``, split into events
    after the block indexes ``splits``, parents chaining across events."""
    full = len(tokens) // block_size
    hashes: list[BlockHash] = []
    extras: list[tuple[Any, ...] | None] = []
    parent: BlockHash | None = None
    for index in range(full):
        block = tokens[index * block_size : (index + 1) * block_size]
        keys = tuple(k for k in (lora, salt if index == 0 else None) if k is not None) or None
        parent = engine_hash(parent, block, keys, kind)
        hashes.append(parent)
        extras.append(keys)
    events = []
    bounds = [0, *sorted({s for s in splits if 0 < s < full}), full] if full else []
    for start, stop in itertools.pairwise(bounds):
        events.append(
            BlockStored(
                block_hashes=hashes[start:stop],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=list(tokens[start * block_size : stop * block_size]),
                block_size=block_size,
                lora_id=1 if lora else None,
                medium="GPU",
                lora_name=lora,
                extra_keys=extras[start:stop] if any(extras[start:stop]) else None,
            )
        )
    return events


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json())


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> VocabDecoder:
    return VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path_factory.mktemp("tok")))


def mirror_of(
    decoder: TokenDecoder, block_bytes: int = BLOCK_BYTES, max_blocks: int = 10**6
) -> HostMirror:
    return HostMirror(
        block_bytes, decoder, lambda lora, salt: chain_seed(lora or MODEL, salt), max_blocks
    )


def stored_bytes(decoder: TokenDecoder, events: Sequence[BlockStored]) -> bytes:
    """The key bytes the stored blocks decode to, pending held back."""
    out, pending = [], b""
    for event in events:
        chunk, pending = decoder.decode(pending, event.token_ids)
        out.append(chunk)
    return b"".join(out)


def assert_mirror_holds_the_routers_blocks(
    mirror: HostMirror,
    decoder: TokenDecoder,
    events: Sequence[BlockStored],
    key: bytes,
    seed: int,
    block_bytes: int = BLOCK_BYTES,
) -> None:
    stored = stored_bytes(decoder, events)
    # What the engine stored is the router's key, then the generation prompt.
    assert (key + GENERATION_PROMPT).startswith(stored)
    covered = prompt_blocks(stored, block_bytes, seed).hashes
    key_hashes = prompt_blocks(key, block_bytes, seed).hashes
    depth = min(len(covered), len(key_hashes))
    assert covered[:depth] == key_hashes[:depth]
    # Exactly the covered router blocks: the key's, and past the key's end only those
    # that run into the generation prompt (one, unless blocks are tiny).
    assert all(router_hash in mirror for router_hash in covered)
    assert len(mirror) == len(set(covered))
    assert len(covered) - depth <= -(-len(GENERATION_PROMPT) // block_bytes)
    assert mirror.matched_depth(key_hashes) == depth


@pytest.mark.parametrize("kind", ["bytes", "int"])
@pytest.mark.parametrize("body", BODIES, ids=["rag", "multi-turn", "non-ascii", "multi-part"])
def test_mirror_holds_the_router_hashes_of_vllm_blocks(tokenizer, vocab, body, kind):
    rendered = chatml(body["messages"])
    tokens = tokenizer.encode(rendered, add_special_tokens=False).ids
    events = engine_events(tokens, ENGINE_BLOCK, splits=(1, 2, 5), kind=kind)
    assert len(events) >= 3
    mirror = mirror_of(vocab)
    gained = sum(mirror.stored(event) for event in events)
    key = router_key(body)
    assert gained == len(mirror) > 3
    # The whole prompt decodes to the key and the generation prompt, as the library says.
    assert vocab.decode(b"", tokens)[0] == key + GENERATION_PROMPT
    assert tokenizer.decode(tokens, skip_special_tokens=True).encode() == key + GENERATION_PROMPT
    assert_mirror_holds_the_routers_blocks(mirror, vocab, events, key, chain_seed(MODEL, None))
    assert mirror.stats.stored == len(tokens) // ENGINE_BLOCK
    assert mirror.stats.router_blocks == len(mirror)
    assert mirror.stats.unmapped == mirror.stats.opaque == 0


@pytest.mark.parametrize("body", BODIES, ids=["rag", "multi-turn", "non-ascii", "multi-part"])
def test_mirror_holds_the_router_hashes_of_simulator_blocks(body):
    # The simulator publishes each character of its ChatML text as its code point.
    tokens = [ord(char) for char in prompt_text("chat", body)]
    events = engine_events(tokens, 64, splits=(3, 4, 20))
    mirror = mirror_of(CodepointDecoder())
    for event in events:
        mirror.stored(event)
    key = router_key(body)
    assert len(mirror) > 3
    assert CodepointDecoder().decode(b"", tokens)[0] == key + GENERATION_PROMPT
    assert_mirror_holds_the_routers_blocks(
        mirror, CodepointDecoder(), events, key, chain_seed(MODEL, None)
    )


def test_the_next_turn_matches_the_reply_the_engine_cached(tokenizer, vocab):
    # Turn 1's prompt and its generated reply are cached; turn 2 resends both.
    turn1 = BODIES[0]["messages"]
    reply = prose(9, 2500)
    tokens = tokenizer.encode(chatml(turn1), add_special_tokens=False).ids
    tokens += tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False).ids
    mirror = mirror_of(vocab)
    for event in engine_events(tokens, ENGINE_BLOCK, splits=(4,)):
        mirror.stored(event)
    turn2 = {
        "model": MODEL,
        "messages": [
            *turn1,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "more?"},
        ],
    }
    key1 = router_key({"model": MODEL, "messages": turn1})
    hashes2 = prompt_blocks(router_key(turn2), BLOCK_BYTES, chain_seed(MODEL, None)).hashes
    stored = vocab.decode(b"", tokens[: len(tokens) // ENGINE_BLOCK * ENGINE_BLOCK])[0]
    assert router_key(turn2).startswith(stored)
    assert mirror.matched_depth(hashes2) == len(stored) // BLOCK_BYTES
    assert len(stored) // BLOCK_BYTES > len(key1) // BLOCK_BYTES + 2


@pytest.mark.parametrize(
    ("salt", "lora", "seed"),
    [
        ("tenant-a", None, chain_seed(MODEL, "tenant-a")),
        (None, "adapter", chain_seed("adapter", None)),
        ("tenant-a", "adapter", chain_seed("adapter", "tenant-a")),
    ],
)
def test_salt_and_lora_choose_the_seed(tokenizer, vocab, salt, lora, seed):
    body = BODIES[0]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    events = engine_events(tokens, ENGINE_BLOCK, splits=(2,), salt=salt, lora=lora)
    assert events[0].extra_keys is not None
    mirror = mirror_of(vocab)
    for event in events:
        mirror.stored(event)
    key = router_key(body)
    assert_mirror_holds_the_routers_blocks(mirror, vocab, events, key, seed)
    unsalted = prompt_blocks(key, BLOCK_BYTES, chain_seed(MODEL, None)).hashes
    assert mirror.matched_depth(unsalted) == 0


def _stored_mirror(
    tokenizer: Tokenizer, vocab: VocabDecoder, **options: Any
) -> tuple[HostMirror, list[BlockStored], tuple[int, ...]]:
    body = BODIES[0]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    events = engine_events(tokens, ENGINE_BLOCK, splits=(2, 4), **options)
    mirror = mirror_of(vocab)
    for event in events:
        mirror.stored(event)
    return (
        mirror,
        events,
        prompt_blocks(router_key(body), BLOCK_BYTES, chain_seed(MODEL, None)).hashes,
    )


def removal(hashes: Sequence[BlockHash], **fields: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=fields.pop("medium", "GPU"), **fields)


def test_removed_blocks_take_their_router_blocks_along(tokenizer, vocab):
    mirror, events, hashes = _stored_mirror(tokenizer, vocab)
    depth = mirror.matched_depth(hashes)
    before = len(mirror)
    # vLLM evicts a prompt's deepest blocks first.
    lost = mirror.removed(removal(events[-1].block_hashes))
    assert lost == before - len(mirror) > 0
    stored = stored_bytes(vocab, events[:-1])
    assert mirror.matched_depth(hashes) == len(stored) // BLOCK_BYTES < depth
    assert mirror.stats.removed == len(events[-1].block_hashes)
    # Storing them again brings them back.
    assert mirror.stored(events[-1]) == lost
    # Removing the engine blocks of the first router block leaves a gap: nothing past it
    # is a match, though later router blocks are still held.
    assert len(stored_bytes(vocab, events[:2])) >= BLOCK_BYTES
    mirror.removed(removal(events[0].block_hashes))
    mirror.removed(removal(events[1].block_hashes))
    assert mirror.matched_depth(hashes) == 0
    assert mirror.stats.router_blocks == len(mirror) > 0


def test_a_router_block_two_engine_blocks_complete_is_counted_twice(tokenizer, vocab):
    mirror, events, hashes = _stored_mirror(tokenizer, vocab)
    held = len(mirror)
    body = BODIES[0]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    # The same text under other engine hashes (say, another block size).
    others = engine_events(tokens, 64, splits=(3,))
    assert sum(mirror.stored(event) for event in others) <= 1  # only past the 128s' end
    for event in events:
        mirror.removed(removal(event.block_hashes))
    assert mirror.matched_depth(hashes) == len(stored_bytes(vocab, others)) // BLOCK_BYTES
    for event in others:
        mirror.removed(removal(event.block_hashes))
    assert len(mirror) == 0 < held


def test_stored_again_changes_nothing(tokenizer, vocab):
    # vLLM reports a prefix-cache hit by storing the hit blocks again.
    mirror, events, _ = _stored_mirror(tokenizer, vocab)
    held, stored = len(mirror), mirror.stats.stored
    assert sum(mirror.stored(event) for event in events) == 0
    assert (len(mirror), mirror.stats.stored) == (held, stored)


def test_clear_forgets_everything(tokenizer, vocab):
    mirror, events, hashes = _stored_mirror(tokenizer, vocab)
    mirror.clear()
    assert len(mirror) == mirror.matched_depth(hashes) == mirror.stats.router_blocks == 0
    # A child of a cleared block has no parent to continue.
    mirror.stored(events[-1])
    assert len(mirror) == 0
    assert mirror.stats.unmapped == len(events[-1].block_hashes)


def test_a_block_whose_parent_is_unknown_is_unmapped(tokenizer, vocab):
    body = BODIES[0]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    events = engine_events(tokens, ENGINE_BLOCK, splits=(2, 4))
    mirror = mirror_of(vocab)
    # Joined late: the first event was missed, and so is everything that continues it.
    for event in events[1:]:
        assert mirror.stored(event) == 0
    assert len(mirror) == 0
    assert mirror.stats.unmapped == sum(len(e.block_hashes) for e in events[1:])
    assert mirror.stats.stored == 0


def test_memory_is_bounded_oldest_first(tokenizer, vocab):
    body = BODIES[0]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    events = engine_events(tokens, 16, splits=range(1, 10**4))
    keep = len(events) // 2
    mirror = mirror_of(vocab, max_blocks=keep)
    for event in events:
        mirror.stored(event)
    assert mirror.stats.evicted == len(events) - keep
    # What the most recent blocks completed is still held; the prefix is not.
    recent = len(stored_bytes(vocab, events[-keep:]))
    assert recent // BLOCK_BYTES <= len(mirror) <= recent // BLOCK_BYTES + 1
    hashes = prompt_blocks(router_key(body), BLOCK_BYTES, chain_seed(MODEL, None)).hashes
    assert mirror.matched_depth(hashes) == 0
    assert all(router_hash in mirror for router_hash in hashes[-len(mirror) :])
    # A block continuing an evicted one cannot be mapped any more.
    mirror.stored(events[1])
    assert mirror.stats.unmapped == 1


def test_what_depends_on_more_than_text_is_opaque(tokenizer, vocab):
    body = BODIES[0]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    [event] = engine_events(tokens, ENGINE_BLOCK)
    blocks = len(event.block_hashes)
    # An image's (identifier, offset) in the third block: that block and its children.
    extra: list[tuple[Any, ...] | None] = [None] * blocks
    extra[2] = (("mm-hash", 5),)
    mirror = mirror_of(vocab)
    mirror.stored(_replace(event, extra_keys=extra))
    assert (mirror.stats.stored, mirror.stats.opaque) == (2, blocks - 2)
    # A prompt-embedding digest in the first block: nothing.
    mirror = mirror_of(vocab)
    mirror.stored(_replace(event, extra_keys=[(b"digest",)] + [None] * (blocks - 1)))
    assert (len(mirror), mirror.stats.opaque) == (0, blocks)
    # Token ids the vocabulary does not have.
    mirror = mirror_of(vocab)
    bad = [*event.token_ids[:-1], 10**6]
    mirror.stored(_replace(event, token_ids=bad))
    assert (mirror.stats.stored, mirror.stats.opaque) == (blocks - 1, 1)


def test_an_opaque_block_continuing_a_known_one(tokenizer, vocab):
    _, events, _ = _stored_mirror(tokenizer, vocab)
    fresh = mirror_of(vocab)
    fresh.stored(events[0])
    blocks = len(events[1].block_hashes)
    fresh.stored(_replace(events[1], extra_keys=[(("mm-hash", 0),)] + [None] * (blocks - 1)))
    assert (fresh.stats.stored, fresh.stats.opaque) == (len(events[0].block_hashes), blocks)


def test_a_known_block_after_a_new_one_keeps_its_state(tokenizer, vocab):
    mirror, events, hashes = _stored_mirror(tokenizer, vocab)
    held, depth, stored = len(mirror), mirror.matched_depth(hashes), mirror.stats.stored
    # The first block was removed and comes back with the blocks after it, still held.
    mirror.removed(removal(events[0].block_hashes[:1]))
    mirror.stored(events[0])
    assert (len(mirror), mirror.matched_depth(hashes)) == (held, depth)
    assert mirror.stats.stored == stored + 1
    # Every refcount is still one per engine block: removing them all empties the mirror.
    for event in events:
        mirror.removed(removal(event.block_hashes))
    assert len(mirror) == 0
    assert mirror.removed(removal([b"never stored"])) == 0


def test_events_read_off_the_wire(tokenizer, vocab):
    # msgspec gives back lists and tuples of its own choosing; the mirror reads them.
    body = BODIES[2]
    tokens = tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids
    events = engine_events(tokens, ENGINE_BLOCK, splits=(1, 3), salt="t", lora="adapter")
    batch = decode_batch(encode_batch(EventBatch(ts=0.0, events=list(events))))
    mirror = mirror_of(vocab)
    for event in batch.events:
        assert isinstance(event, BlockStored)
        mirror.stored(event)
    seed = chain_seed("adapter", "t")
    assert_mirror_holds_the_routers_blocks(mirror, vocab, events, router_key(body), seed)


def test_a_malformed_event_is_unmapped(vocab):
    event = BlockStored(
        block_hashes=[b"a", b"b"], parent_block_hash=None, token_ids=[5] * 7,
        block_size=4, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    mirror = mirror_of(vocab)
    assert mirror.stored(event) == 0
    assert mirror.stats.unmapped == 2


def test_other_groups_and_tiers_are_not_followed(tokenizer, vocab):
    mirror, events, hashes = _stored_mirror(tokenizer, vocab)
    depth = mirror.matched_depth(hashes)
    # A sliding-window group or the CPU tier dropping the same blocks: still held on GPU.
    mirror.removed(removal(events[0].block_hashes, group_idx=1))
    mirror.removed(removal(events[0].block_hashes, medium="CPU"))
    assert mirror.matched_depth(hashes) == depth
    fresh = mirror_of(vocab)
    fresh.stored(_replace(events[0], group_idx=1))
    fresh.stored(_replace(events[0], medium="CPU"))
    assert len(fresh) == 0
    assert fresh.stats.ignored == 2 * len(events[0].block_hashes)
    # No group (an older vLLM) is the followed group.
    for event in events:
        fresh.stored(_replace(event, group_idx=None, medium=None))
    assert fresh.matched_depth(hashes) == depth


def _replace(event: BlockStored, **changes: Any) -> BlockStored:
    fields = {name: getattr(event, name) for name in event.__struct_fields__}
    return BlockStored(**{**fields, **changes})


# Random conversations.

_TEXT = st.lists(
    st.sampled_from([*"abc xyz\n\t,.:<|>é中😀∑ŝ", "the ", "alpha "]), max_size=150
).map("".join)
_CONTENT = st.one_of(
    _TEXT,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, _TEXT), min_size=1, max_size=3),
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _CONTENT}
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(_MESSAGE, min_size=1, max_size=6),
    decoder_kind=st.sampled_from(["vocab", "codepoint"]),
    engine_block=st.sampled_from([1, 3, 16, 128]),
    block_bytes=st.sampled_from([8, 64, 512]),
    splits=st.lists(st.integers(1, 200), max_size=4),
    salt=st.none() | st.just("s1"),
)
def test_random_conversations(
    tokenizer, vocab, messages, decoder_kind, engine_block, block_bytes, splits, salt
):
    body = {"model": MODEL, "messages": messages}
    decoder: TokenDecoder
    if decoder_kind == "vocab":
        decoder = vocab
        tokens = tokenizer.encode(chatml(messages), add_special_tokens=False).ids
    else:
        decoder = CodepointDecoder()
        tokens = [ord(char) for char in prompt_text("chat", body)]
    events = engine_events(tokens, engine_block, splits, salt=salt)
    mirror = mirror_of(decoder, block_bytes)
    for event in events:
        mirror.stored(event)
    assert_mirror_holds_the_routers_blocks(
        mirror, decoder, events, router_key(body), chain_seed(MODEL, salt), block_bytes
    )
    for event in events:
        mirror.removed(removal(event.block_hashes))
    assert len(mirror) == 0


def test_nothing_past_the_deepest_key_is_decoded_or_held():
    # A prompt of 20 router blocks, mirrored with room for 8 blocks of key: the first 8
    # blocks are held (as deep as any request's key reaches), the engine blocks past them
    # are remembered, so their children are not "unmapped", but cost no decoding.
    body = {"model": MODEL, "messages": [{"role": "user", "content": prose(5, 20 * BLOCK_BYTES)}]}
    tokens = [ord(char) for char in prompt_text("chat", body)]
    events = engine_events(tokens, 64, splits=range(8, 400, 8))  # a router block each
    capped = HostMirror(
        BLOCK_BYTES,
        CodepointDecoder(),
        lambda lora, salt: chain_seed(lora or MODEL, salt),
        10**6,
        max_key_bytes=8 * BLOCK_BYTES,
    )
    for event in events:
        capped.stored(event)
    hashes = prompt_blocks(router_key(body), BLOCK_BYTES, chain_seed(MODEL, None)).hashes
    assert capped.matched_depth(hashes) >= 8
    assert capped.matched_depth(hashes) < 10  # the event crossing the cap is decoded whole
    assert capped.stats.unmapped == 0
    assert capped.stats.stored == len(tokens) // 64


def test_the_mirror_names_each_router_block_a_stored_engine_block_completes():
    body = BODIES[0]
    tokens = [ord(char) for char in prompt_text("chat", body)]
    events = engine_events(tokens, 64, splits=(3, 4, 20))
    told: list[int] = []
    mirror = HostMirror(
        BLOCK_BYTES,
        CodepointDecoder(),
        lambda lora, salt: chain_seed(lora or MODEL, salt),
        10**6,
        on_stored=told.extend,
    )
    for event in events:
        mirror.stored(event)
    # Every router block the events made held, each once: what ends its speculation.
    assert sorted(told) == sorted(set(told)) and set(told) == {h for h in told if h in mirror}
    assert len(told) == len(mirror) > 3


@pytest.mark.parametrize("body", BODIES, ids=["rag", "multi-turn", "non-ascii", "multi-part"])
def test_the_engine_holds_the_start_of_the_block_a_match_stops_in(tokenizer, vocab, body):
    # Engine blocks of 16 tokens end anywhere in a 512-byte router block: past the whole
    # blocks a request matches, the engine holds the start of the next one too.
    key = router_key(body)
    seed = chain_seed(MODEL, None)
    for decoder, tokens in (
        (vocab, tokenizer.encode(chatml(body["messages"]), add_special_tokens=False).ids),
        (CodepointDecoder(), [ord(char) for char in prompt_text("chat", body)]),
    ):
        mirror = mirror_of(decoder)
        cut = len(tokens) * 2 // 3 // 16 * 16  # the engine holds the prompt this far
        events = engine_events(tokens[:cut], 16, splits=(2, 7))
        for event in events:
            mirror.stored(event)
        stored = stored_bytes(decoder, events)
        assert key.startswith(stored)
        blocks = prompt_blocks(key, BLOCK_BYTES, seed)
        depth = mirror.matched_depth(blocks.hashes)
        assert depth == len(stored) // BLOCK_BYTES
        chain = blocks.prefix_hash(depth)
        rest = key[depth * BLOCK_BYTES : (depth + 1) * BLOCK_BYTES - 1]
        assert mirror.tail_bytes(chain, rest) == len(stored) - depth * BLOCK_BYTES > 0
        # A prompt that leaves the engine's text there, or another tenant's, holds none.
        assert mirror.tail_bytes(chain, b"!" + rest[1:]) == 0
        assert mirror.tail_bytes(chain_seed(MODEL, "tenant"), rest) == 0


def test_a_removed_or_cleared_block_takes_its_tail_along():
    body = BODIES[1]
    key = router_key(body)
    tokens = [ord(char) for char in prompt_text("chat", body)][:1200]
    events = engine_events(tokens, 16, splits=(40, 50))
    mirror = mirror_of(CodepointDecoder())
    for event in events:
        mirror.stored(event)
    blocks = prompt_blocks(key, BLOCK_BYTES, chain_seed(MODEL, None))
    depth = mirror.matched_depth(blocks.hashes)
    chain, rest = blocks.prefix_hash(depth), key[depth * BLOCK_BYTES :]
    held = mirror.tail_bytes(chain, rest)
    assert held == len(stored_bytes(CodepointDecoder(), events)) - depth * BLOCK_BYTES > 0
    # The same text under other engine hashes (a second entry) holds it too.
    twin = engine_events(tokens, 16, splits=(40, 50), kind="int")
    for event in twin:
        mirror.stored(event)
    mirror.removed(removal(events[-1].block_hashes))
    assert mirror.tail_bytes(chain, rest) == held
    # Once the block stored last past that router block is gone, nothing is claimed of it.
    mirror.removed(removal(twin[-1].block_hashes))
    assert mirror.tail_bytes(chain, rest) == 0
    mirror.stored(events[-1])
    assert mirror.tail_bytes(chain, rest) == held
    mirror.clear()
    assert mirror.tail_bytes(chain, rest) == 0


def test_a_new_chat_after_a_shared_prompt_is_credited_the_prompts_engine_blocks():
    # Two chats stored one after the other share a system prompt: the second's events
    # start past the engine blocks the first stored. A third chat continues neither chat,
    # only the prompt: the engine holds it up to the last engine block inside what it
    # shares with them (engine blocks of 16 characters, from the start).
    system = prose(1, 700) + " user: "
    chats = [system + prose(10 + i, 300) for i in range(2)]
    mirror = mirror_of(CodepointDecoder())
    for chat in chats:
        for event in engine_events([ord(char) for char in chat], 16):
            mirror.stored(event)
    key = (system + "a question of its own").encode()
    blocks = prompt_blocks(key, BLOCK_BYTES, chain_seed(MODEL, None))
    depth = mirror.matched_depth(blocks.hashes)
    assert depth == len(system) // BLOCK_BYTES == 1
    shared = max(
        next(i for i, (a, b) in enumerate(zip(key, chat.encode(), strict=False)) if a != b)
        for chat in chats
    )
    held = mirror.tail_bytes(blocks.prefix_hash(depth), key[BLOCK_BYTES : 2 * BLOCK_BYTES - 1])
    assert held == shared // 16 * 16 - BLOCK_BYTES > 0
    # Each chat's next turn continues its own chain past the prompt's block, and is
    # credited all that its engine blocks hold of the block its match stops in.
    for chat in chats:
        turn = (chat + " and more").encode()
        hashes = prompt_blocks(turn, BLOCK_BYTES, chain_seed(MODEL, None))
        depth = mirror.matched_depth(hashes.hashes)
        assert depth == len(chat) // BLOCK_BYTES == 2
        rest = turn[2 * BLOCK_BYTES : 3 * BLOCK_BYTES - 1]
        assert mirror.tail_bytes(hashes.prefix_hash(2), rest) == len(chat) // 16 * 16 - 1024
