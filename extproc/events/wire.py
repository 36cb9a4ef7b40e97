"""vLLM's KV-cache event batch, as it travels on the wire.

These Structs mirror ``vllm/distributed/kv_events.py`` (vLLM 0.32) field for field and
option for option, so that ``encode_batch`` writes the bytes vLLM writes and
``decode_batch`` reads the bytes vLLM sends. ``tests/events/test_wire.py`` checks both
directions against vLLM's own classes.

What the bytes look like (checked empirically, not only read):

* The batch is ``array_like``: ``[ts, [events...], data_parallel_rank]``. msgspec does not
  drop a trailing default from an array-like struct, so the rank is always sent, ``nil``
  when unset.
* An event is a tagged *map*, not an array: ``{"type": "BlockStored", "block_hashes": ...}``.
  The tag is the class name, so our class names must stay vLLM's. Fields at their default
  are left out (``omit_defaults``), so an event from an older vLLM decodes with defaults.

Forward compatibility with a newer vLLM:

* A new field on an event is a new map key; msgspec ignores unknown keys, so it decodes.
* A new trailing element of the batch array is ignored by msgspec too.
* A new event *type* is an unknown tag: the whole batch fails with ``EventDecodeError``.
  Skipping just that event would be wrong; we cannot know whether it removed blocks, so
  the subscriber counts the batch as undecodable and stops trusting the host instead.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from extproc.errors import RouterError

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventDecodeError",
    "KvEvent",
    "decode_batch",
    "encode_batch",
]

BlockHash = bytes | int
"""An engine block hash: SHA-256 bytes by default, a 64-bit int when vLLM runs with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""


class EventDecodeError(RouterError):
    """A payload on the KV-event stream is not a batch this version can read (garbage,
    truncated, or an event type from a newer vLLM)."""


class _KvEventBase(
    msgspec.Struct,
    tag=True,
    omit_defaults=True,
    gc=False,
    frozen=True,
):
    """vLLM's ``KVCacheEvent``: a map tagged ``"type": <class name>``."""


class BlockStored(_KvEventBase, frozen=True):
    """Blocks entered the engine's cache, in chain order (``parent_block_hash`` is the
    block before the first one, ``None`` at the start of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_KvEventBase, frozen=True):
    """Blocks left the engine's cache (evicted or freed)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KvEventBase, frozen=True):
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
    frozen=True,
):
    """vLLM's ``KVEventBatch``: what one engine step published, as one message."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack bytes vLLM's publisher would send for ``batch``."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """Read one batch; anything malformed raises ``EventDecodeError``."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise EventDecodeError(f"undecodable KV event batch: {exc}") from exc
