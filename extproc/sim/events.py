"""The simulator's KV-cache events: its cache's changes, published as vLLM publishes them.

`EventRecorder` is the `PrefixCache`'s listener. It turns each change into vLLM's wire
event (`extproc/events/wire.py`) and keeps it until the end of the engine step, as vLLM's
block pool queues events until the scheduler takes them. `EventStream` adds the publisher:
at each step's end it sends what the step recorded as one `EventBatch` (none when the step
changed nothing, as vLLM), and it describes itself for ``GET /kv_event_sources``.

What the events carry, and how they match vLLM's (``vllm/v1/core/block_pool.py``):

* ``BlockStored``: a block cached for the first time, in runs of one chain's consecutive
  blocks with the block before the run as ``parent_block_hash`` (None at a chain's start).
  The block hashes are the simulator's own 64-bit integers (vLLM sends ints too, with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). The simulator has no tokenizer: each character
  of the block's text is one token whose id is its Unicode code point, so ``block_size``
  is characters per block and ``len(token_ids) == len(block_hashes) * block_size``.
  ``extra_keys`` has one entry per block, None but for a salted chain's first block,
  ``(cache_salt,)``, as vLLM's ``to_event_extra_keys`` writes them. No LoRA adapters are
  modelled, so ``lora_id`` and ``lora_name`` are None. ``medium`` is ``"GPU"`` and
  ``group_idx`` 0, vLLM's single KV-cache group.
* ``BlockRemoved``: one event per evicted block, as vLLM sends them.
* ``AllBlocksCleared``: a reset with no block held (see ``PrefixCache.clear_unreferenced``).

``GET /kv_event_sources`` answers as vLLM's API server does: per data-parallel rank (the
simulator has one, ``"0"``), the publisher's ``KVEventsConfig``. One key is the simulator's
own, ``"token_ids": "codepoints"``: how to decode this engine's token ids (vLLM sends no
such key; a consumer of real vLLM decodes with the model's tokenizer).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final

import msgspec
import zmq

from extproc.events.publisher import EventPublisher
from extproc.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["TOKEN_IDS", "TOPIC", "EventRecorder", "EventStream", "token_ids"]

TOPIC: Final = "kv"
# The extra /kv_event_sources key: this engine's token ids are Unicode code points.
TOKEN_IDS: Final = "codepoints"
MEDIUM: Final = "GPU"  # vLLM's MEDIUM_GPU
# Tokens a step stores at most (vLLM's max_num_batched_tokens is 2048 to 16384 by
# default, by model and hardware).
STEP_TOKENS: Final = 8192
GROUP_IDX: Final = 0  # vLLM's KV-cache group of a model with one attention type
# vLLM's KVEventsConfig defaults, reported as its /kv_event_sources reports them; our
# publisher has no such queue bounds of its own (publishing never blocks).
_VLLM_HWM: Final = 100_000
_VLLM_MAX_QUEUE_SIZE: Final = 100_000
_BUFFER_BATCHES: Final = 10_000
# Native-order UTF-32 reads back as one unsigned int per character: the code points,
# several times faster than map(ord, ...).
_UTF32: Final = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"
assert array.array("I").itemsize == 4


def token_ids(text: str) -> list[int]:
    """The simulator's token ids of `text`: one per character, its code point."""
    # surrogatepass: a JSON prompt can carry lone surrogates; they are code points too.
    return array.array("I", text.encode(_UTF32, "surrogatepass")).tolist()


class EventRecorder:
    """A `CacheListener` that records the cache's changes as vLLM's wire events."""

    def __init__(self, block_chars: int) -> None:
        self._block_chars = block_chars
        self._pending: list[KvEvent] = []

    def stored(
        self, hashes: Sequence[int], parent: int | None, text: str, salt: str | None
    ) -> None:
        extra_keys: list[tuple[Any, ...] | None] = [None] * len(hashes)
        if salt:
            extra_keys[0] = (salt,)
        self._pending.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=token_ids(text),
                block_size=self._block_chars,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                extra_keys=extra_keys,
                group_idx=GROUP_IDX,
            )
        )

    def removed(self, hashes: Sequence[int]) -> None:
        self._pending.extend(
            BlockRemoved(block_hashes=[block_hash], medium=MEDIUM, group_idx=GROUP_IDX)
            for block_hash in hashes
        )

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    def take(self) -> list[KvEvent]:
        """The events recorded since the last take, oldest first."""
        events, self._pending = self._pending, []
        return events


def step_batches(events: Sequence[KvEvent], max_tokens: int) -> list[list[KvEvent]]:
    """``events`` in order, cut into batches of at most ``max_tokens`` stored tokens (a
    ``BlockStored`` of more is split, its pieces chained by parent)."""
    batches: list[list[KvEvent]] = []
    batch: list[KvEvent] = []
    tokens = 0
    for event in events:
        pieces: list[KvEvent] = [event]
        if isinstance(event, BlockStored) and len(event.token_ids) > max_tokens:
            pieces = list(_split(event, max(1, max_tokens // event.block_size)))
        for piece in pieces:
            size = len(piece.token_ids) if isinstance(piece, BlockStored) else 0
            if batch and tokens + size > max_tokens:
                batches.append(batch)
                batch, tokens = [], 0
            batch.append(piece)
            tokens += size
    if batch:
        batches.append(batch)
    return batches


def _split(event: BlockStored, blocks: int) -> Iterator[BlockStored]:
    size, parent = event.block_size, event.parent_block_hash
    extra = event.extra_keys
    for start in range(0, len(event.block_hashes), blocks):
        hashes = event.block_hashes[start : start + blocks]
        yield msgspec.structs.replace(
            event,
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=event.token_ids[start * size : (start + len(hashes)) * size],
            extra_keys=None if extra is None else extra[start : start + len(hashes)],
        )
        parent = hashes[-1]


def _zmq_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "*"
    return f"[{host}]" if ":" in host else host


class EventStream:
    """One instance's KV-event publisher, bound on the instance's own IP.

    Ports: the PUB socket on `port`, the replay ROUTER on `replay_port`; 0 picks a free
    one. Instances on distinct IPs (127.0.0.11, .12, ...) can share the port numbers."""

    def __init__(self, host: str, port: int, replay_port: int, block_chars: int) -> None:
        self.recorder = EventRecorder(block_chars)
        zmq_host = _zmq_host(host)
        try:
            self._publisher = EventPublisher(
                f"tcp://{zmq_host}:{port}",
                f"tcp://{zmq_host}:{replay_port}",
                TOPIC,
                buffer_batches=_BUFFER_BATCHES,
            )
        except zmq.ZMQError as error:
            # As a taken HTTP port fails: an OSError naming what could not be bound.
            raise OSError(
                error.errno,
                f"KV events: cannot bind tcp://{zmq_host}:{port} and :{replay_port}: {error}"
                " (simulators sharing an IP need distinct kv_events ports, or port 0)",
            ) from error
        # vLLM reports its configured endpoint, tcp://*:5557 (the consumer puts in the
        # engine's host), but what it bound for tcp://*:0. Same here.
        self._endpoint = f"tcp://*:{port}" if port else self._publisher.endpoint
        replay = self._publisher.replay_endpoint
        assert replay is not None
        self._replay_endpoint = f"tcp://*:{replay_port}" if replay_port else replay

    @property
    def endpoint(self) -> str:
        """The PUB address actually bound."""
        return self._publisher.endpoint

    def end_step(self) -> None:
        """Publish what the cache recorded since the last step, in batches of at most
        ``STEP_TOKENS`` tokens: a vLLM step computes no more than its token budget, so a
        consumer never gets a megabyte prompt in one message (the simulator, which takes
        any prompt in one step, would send one)."""
        for batch in step_batches(self.recorder.take(), STEP_TOKENS):
            self._publisher.publish(batch)

    def source(self) -> dict[str, Any]:
        """This rank's entry of ``GET /kv_event_sources``: vLLM's KVEventsConfig, field
        for field, plus the simulator's ``token_ids``."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self._endpoint,
            "replay_endpoint": self._replay_endpoint,
            "buffer_steps": _BUFFER_BATCHES,
            "hwm": _VLLM_HWM,
            "max_queue_size": _VLLM_MAX_QUEUE_SIZE,
            "topic": TOPIC,
            "token_ids": TOKEN_IDS,
        }

    def close(self) -> None:
        """Close both sockets; events not sent yet are dropped, as vLLM's shutdown may."""
        self._publisher.close()
