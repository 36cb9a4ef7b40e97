"""One engine's prefix cache, in the router's block hashes, rebuilt from its KV events.

An engine block is named by a hash of token ids that the router cannot compute, but it
arrives with its tokens and its parent. Decoding the tokens (``tokens.py``) and continuing
the parent's router chain over the bytes (with ``picker/blocks.chain_hashes``, which
chains a request's key too) tells which router blocks the engine block completes. So any
router process that sees a host's events can answer "does this host hold router block
X", with the hashes the router computes for a request, and without tokenizing anything.

Per engine block the mirror keeps the state after it: the router chain so far, the bytes
past the last full router block, the decoder's pending bytes, and the router hashes it
completed. A later block resumes from its parent's state; a removed block gives back what
it completed. Router hashes are reference-counted, because two engine blocks can complete
the same one (the same text under two engine hashes, a partial-block entry beside the
full block).

What cannot be mapped is skipped and counted, never guessed:

* a block whose parent the mirror never saw (it joined late, or the parent was removed
  or evicted from the mirror): ``unmapped``;
* a block whose KV depends on more than its text (images, prompt embeddings: non-string
  extra keys) or whose tokens do not decode: ``opaque``;
* every block after such a block in the same event, which has no parent state either.

The mirror follows one KV-cache group (``group_idx``; events without one count as it)
and the GPU tier only: a sliding-window group or an offloading tier reports blocks that
are no evidence of the full prefix in GPU memory, and their removals would take away
blocks the followed group still holds.

The held set is not prefix-closed: a removal or an unmapped block can leave a gap, and
the engine can use nothing past a gap. ``matched_depth`` therefore walks the chain rather
than binary-searching it (a chain is at most a few hundred router blocks).

An engine block is much smaller than a router block (16 tokens, some 60 bytes, against
512), so the engine also holds the start of the router block a request's match stops in:
up to a router block of every hit that whole blocks leave out (conversations, whose turns
end anywhere in a block, read some 6 points low). ``tail_bytes`` finds it from the last
engine block stored past each router block, the one a conversation's next turn continues,
and the point where its path left the one stored before it, which a new chat after a
shared system prompt reaches: one dict entry per engine block stored. (Hashing the tail
again in 64-byte steps doubled the ingestion cost, past its budget of a quarter core; a
list of every engine block's end per router block cost +50%, mostly in the garbage
collector's passes over the lists.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from extproc.events.tokens import TokenDecoder
from extproc.events.wire import BlockHash, BlockRemoved, BlockStored
from extproc.picker.blocks import chain_hashes

# (LoRA name or None, cache salt or None) -> the seed of the router chain.
SeedOf = Callable[[str | None, str | None], int]

# The tier the router routes on. vLLM's block pool labels its events "GPU"; an event with
# no medium is from a vLLM that predates the field.
_FOLLOWED = frozenset({None, "GPU"})


@dataclass(slots=True)
class MirrorStats:
    """Counts since the mirror was made (``router_blocks``: held now)."""

    # Engine blocks mapped, and engine blocks removed that had been mapped.
    stored: int = 0
    removed: int = 0
    # Engine blocks skipped because their parent is unknown (or the event is malformed).
    unmapped: int = 0
    # Engine blocks skipped because their KV is not a function of their text alone, or
    # their tokens do not decode.
    opaque: int = 0
    # Engine block states dropped to stay within ``max_engine_blocks``.
    evicted: int = 0
    # Engine blocks of another KV-cache group or tier, not followed.
    ignored: int = 0
    router_blocks: int = 0


# The router's view after one engine block: (chain, tail, pending, completed, depth).
#   chain: the hash of the last full router block (the seed before the first one);
#   tail: the key bytes past that router block;
#   pending: the decoder's held-back bytes;
#   completed: the router blocks this engine block completed;
#   depth: bytes of key text up to the end of this engine block.
# A plain tuple, not a NamedTuple: one is built per engine block, and a NamedTuple's
# constructor costs ten times as much.
_Block = tuple[int, bytes, bytes, tuple[int, ...], int]
_COMPLETED: Final = 3

_NONE: tuple[int, ...] = ()


class HostMirror:
    """What one engine holds, as the router's block hashes, rebuilt from its events."""

    def __init__(
        self,
        block_bytes: int,
        decoder: TokenDecoder,
        seed_of: SeedOf,
        max_engine_blocks: int,
        group_idx: int = 0,
        max_key_bytes: int | None = None,
        on_stored: Callable[[tuple[int, ...]], object] | None = None,
    ) -> None:
        if block_bytes < 1 or max_engine_blocks < 1:
            raise ValueError("block_bytes and max_engine_blocks must be positive")
        self._block_bytes = block_bytes
        self._decode_blocks = decoder.decode_blocks
        self._seed_of = seed_of
        self._max_engine_blocks = max_engine_blocks
        self._group_idx = group_idx
        # The router matches no deeper than its key (match_depth_chars): past this many
        # bytes of key text an engine block is remembered, but not decoded or hashed, so a
        # prompt of megabytes costs what its first part does.
        self._max_key_bytes = max_key_bytes
        # Told the router blocks each stored engine block completes (the precise view
        # ends their speculation).
        self._on_stored = on_stored
        # Engine hash -> state after it, least recently stored first. An OrderedDict: a
        # plain dict popped from the front leaves holes that every later next(iter())
        # walks over, which made eviction quadratic.
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        # Router hash -> how many mapped engine blocks completed it.
        self._held: dict[int, int] = {}
        # Router hash (or seed) -> the tail of the engine block stored last past it; and
        # where that block's path left the one stored before it (see _extend).
        self._tails: dict[int, bytes] = {}
        self._forks: dict[int, int] = {}
        self.stats = MirrorStats()

    def __contains__(self, router_hash: object) -> bool:
        return router_hash in self._held

    def __len__(self) -> int:
        return len(self._held)

    def matched_depth(self, hashes: Sequence[int]) -> int:
        """How many leading router blocks of a chain this engine holds, stopping at the
        first gap (the engine's own prefix match stops there too)."""
        held = self._held
        for depth, router_hash in enumerate(hashes):
            if router_hash not in held:
                return depth
        return len(hashes)

    def tail_bytes(self, chain: int, rest: bytes) -> int:
        """How many leading bytes of ``rest``, the key bytes past the router block named by
        ``chain`` (the seed for none), this engine holds too, by the engine block stored
        last past that block: all of its text where ``rest`` continues it (a
        conversation's next turn), else up to where its path left the path stored before
        it, where ``rest`` goes that far (a new chat after a system prompt that earlier
        chats share), else none."""
        tail = self._tails.get(chain)
        if tail is None:
            return 0
        if rest.startswith(tail):
            return len(tail)
        fork = self._forks.get(chain, 0)
        return fork if fork and rest.startswith(tail[:fork]) else 0

    def stored(self, event: BlockStored) -> int:
        """Map the event's engine blocks; returns how many router blocks became held."""
        group = event.group_idx
        if (group is not None and group != self._group_idx) or event.medium not in _FOLLOWED:
            self.stats.ignored += len(event.block_hashes)
            return 0
        start = self._start(event)
        gained = 0 if start is None else self._extend(start, event)
        if len(self._blocks) > self._max_engine_blocks:
            self._bound()
        self.stats.router_blocks = len(self._held)
        return gained

    def removed(self, event: BlockRemoved) -> int:
        """Forget the event's engine blocks; returns how many router blocks no engine
        block completes any more."""
        group = event.group_idx
        if (group is not None and group != self._group_idx) or event.medium not in _FOLLOWED:
            self.stats.ignored += len(event.block_hashes)
            return 0
        lost = 0
        for engine_hash in event.block_hashes:
            block = self._blocks.pop(engine_hash, None)
            if block is not None:
                self.stats.removed += 1
                lost += self._release(block[_COMPLETED])
                self._drop_tail(block)
        self.stats.router_blocks = len(self._held)
        return lost

    def clear(self) -> None:
        """The engine dropped its whole prefix cache (``AllBlocksCleared``)."""
        self._blocks.clear()
        self._held.clear()
        self._tails.clear()
        self._forks.clear()
        self.stats.router_blocks = 0

    def _start(self, event: BlockStored) -> _Block | None:
        """The state the event's first block continues, or None (counted) if there is
        none: a malformed event, an unknown parent, an opaque first block."""
        count = len(event.block_hashes)
        if event.block_size < 1 or len(event.token_ids) != event.block_size * count:
            # vLLM skips null blocks (sliding window) in the hashes but not in the tokens.
            self.stats.unmapped += count
            return None
        if event.parent_block_hash is not None:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                self.stats.unmapped += count
            return parent
        keys = event.extra_keys[0] if event.extra_keys else None
        if not _text_only(keys):
            self.stats.opaque += count
            return None
        seed = self._seed_of(event.lora_name, _cache_salt(keys, event.lora_name))
        return (seed, b"", b"", _NONE, 0)

    def _extend(self, block: _Block, event: BlockStored) -> int:
        """Map the event's blocks one after another from ``block``.

        The hot path (some 100,000 engine blocks a second at full load): the event's new
        blocks are decoded in one call, and a block that completes no router block then
        costs one concatenation and one dict entry.
        """
        blocks, hashes, size = self._blocks, event.block_hashes, event.block_size
        count, first = len(hashes), 0
        for engine_hash in hashes:  # stored again (vLLM reports prefix hits): now recent
            known = blocks.get(engine_hash)
            if known is None:
                break
            blocks.move_to_end(engine_hash)
            block, first = known, first + 1
        else:
            return 0
        extra, tokens = event.extra_keys, event.token_ids
        stop = count if extra is None else _text_blocks(extra, first, count)
        if first or stop < count:
            hashes, tokens = hashes[first:stop], tokens[first * size : stop * size]
        chain, tail, pending, _, depth = block
        cap = self._max_key_bytes
        if cap is not None and depth >= cap:  # past what any key reaches: just remember it
            for engine_hash in hashes:
                if engine_hash not in blocks:
                    self.stats.stored += 1
                    blocks[engine_hash] = (chain, b"", b"", _NONE, depth)
            return 0
        decoded = self._decode_blocks(pending, tokens, size)
        self.stats.opaque += count - first - len(decoded)
        self.stats.stored += len(decoded)
        block_bytes, tails, forks, gained = self._block_bytes, self._tails, self._forks, 0
        for engine_hash, (out, pending) in zip(hashes, decoded, strict=False):
            if engine_hash in blocks:  # a known block past a new one: keep its state
                self.stats.stored -= 1
                chain, tail, pending, _, depth = blocks[engine_hash]
                blocks.move_to_end(engine_hash)
                continue
            previous = tail  # the block before's text in this router block
            tail += out
            depth += len(out)
            completed = _NONE
            if len(tail) >= block_bytes:
                chain, tail, completed = self._cut(chain, tail)
                gained += self._hold(completed)
            blocks[engine_hash] = (chain, tail, pending, completed, depth)
            if tail:
                if tails.get(chain) is not previous and previous and not completed:
                    # Not the block stored last here, continued: a branch off that path (a
                    # chat after a prompt another chat shares), or its text stored again.
                    # The block before is held, so its text is, up to its end.
                    forks[chain] = len(previous)
                tails[chain] = tail
        return gained

    def _cut(self, chain: int, data: bytes) -> tuple[int, bytes, tuple[int, ...]]:
        """Cut the full router blocks off ``data`` and chain them from ``chain`` as
        ``prompt_blocks`` chains a request's key: (new chain, rest, their hashes)."""
        hashes = chain_hashes(data, self._block_bytes, chain)
        return hashes[-1], data[len(hashes) * self._block_bytes :], hashes

    def _hold(self, router_hashes: tuple[int, ...]) -> int:
        if self._on_stored is not None:
            self._on_stored(router_hashes)
        held, gained = self._held, 0
        for router_hash in router_hashes:
            holders = held.get(router_hash, 0)
            held[router_hash] = holders + 1
            gained += not holders
        return gained

    def _drop_tail(self, block: _Block) -> None:
        """``block`` is gone: so is its tail, if it was the last past its router block (the
        one before it is not known: nothing is claimed past that block until another
        engine block is stored there)."""
        if self._tails.get(block[0]) is block[1]:
            del self._tails[block[0]]
            self._forks.pop(block[0], None)

    def _release(self, router_hashes: tuple[int, ...]) -> int:
        held, lost = self._held, 0
        for router_hash in router_hashes:
            holders = held[router_hash] - 1
            if holders:
                held[router_hash] = holders
            else:
                del held[router_hash]
                lost += 1
        return lost

    def _bound(self) -> None:
        """Drop the least recently stored states past ``max_engine_blocks``, with what
        they completed: the mirror then claims less than the engine holds, never more."""
        blocks, excess = self._blocks, len(self._blocks) - self._max_engine_blocks
        self.stats.evicted += max(0, excess)
        for _ in range(excess):
            block = blocks.popitem(last=False)[1]
            if block[_COMPLETED]:  # most engine blocks complete no router block
                self._release(block[_COMPLETED])
            self._drop_tail(block)


def _text_only(keys: tuple[Any, ...] | None) -> bool:
    """Whether a block's extra keys leave its KV a function of its text: only strings
    (the LoRA name, the cache salt); a multimodal ``(identifier, offset)`` pair or a
    prompt-embedding digest is not text the router can hash."""
    return keys is None or all(isinstance(key, str) for key in keys)


def _text_blocks(extra_keys: list[tuple[Any, ...] | None], start: int, stop: int) -> int:
    """The index of the first block from ``start`` whose extra keys are not text only
    (``stop`` if none): the blocks from there on cannot be mapped."""
    for index in range(start, min(stop, len(extra_keys))):
        if not _text_only(extra_keys[index]):
            return index
    return stop


def _cache_salt(keys: tuple[Any, ...] | None, lora_name: str | None) -> str | None:
    """The cache salt in a prompt's first block's extra keys.

    vLLM publishes them untagged, in the order of ``generate_block_hash_extra_keys``:
    the LoRA name (when the request has an adapter), multimodal pairs, the salt (first
    block only), prompt-embedding digests. So among the strings, the salt is the first
    one after the LoRA name.
    """
    if not keys:
        return None
    strings = [key for key in keys if isinstance(key, str)]
    if lora_name is not None:
        strings = strings[1:]
    return strings[0] if strings else None
