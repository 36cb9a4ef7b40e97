"""A traffic-log record as the decision code reads a prompt, at a chosen block size.

The log holds the chain of block hashes at the router's block size B. A chain at k x B is
every k-th hash of it: hash number k(i+1) - 1 names the prompt up to k(i+1) x B bytes,
which is exactly what block i of a k x B chain names (the values differ, equality does
not).

At the logged block size the logged anchors are the router's own. At k x B the anchor rule
(``PromptBlocks.anchor``) is applied again with the logged message ends: the coarse block's
own hash where the message that continues past the depth has a whole coarse block left;
otherwise the deepest logged hash within the next message, which names the same prefix as
the router's anchor does, to a block. The values differ from a router's at k x B, the
equalities (which prompts share an anchor) do not, to a block.

SageMaker's fixed-length key is the logged digest where the router computed it at that
``prefix_length``; otherwise the hash naming the first ``prefix_length`` characters (to a
whole block), or the whole prompt's if it is no longer.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from extproc.adapter.traffic_log import TrafficRecord
from extproc.picker.blocks import PromptBlocks


@dataclass(frozen=True, slots=True)
class RecordedBlocks(PromptBlocks):
    """``PromptBlocks`` without the text: its length and anchors come from the record."""

    recorded_length: int = 0
    recorded_anchors: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        return self.recorded_length

    def anchor(self, depth: int) -> int:
        return self.recorded_anchors[depth]

    def anchors(self) -> list[int]:
        return list(self.recorded_anchors)


def recorded_blocks(record: TrafficRecord, multiple: int = 1) -> RecordedBlocks:
    """The record's prompt in blocks of ``multiple`` x its block size."""
    hashes, anchors = record.hashes, record.anchors
    if multiple > 1:
        hashes, anchors = hashes[multiple - 1 :: multiple], coarse_anchors(record, multiple)
    return RecordedBlocks(
        seed=record.seed,
        hashes=hashes,
        block_bytes=record.block_bytes * multiple,
        key=b"",
        whole=record.whole,
        recorded_length=record.bytes,
        recorded_anchors=anchors,
    )


def coarse_anchors(record: TrafficRecord, multiple: int) -> tuple[int, ...]:
    """The anchor at every depth of the record's chain at ``multiple`` x its block size."""
    fine, ends, length = record.hashes, record.ends, record.bytes
    block = record.block_bytes
    coarse = block * multiple
    anchors = []
    at = 0  # ends[at] is the first message end past the depth's start
    for depth in range(len(fine) // multiple + 1):
        start = depth * coarse
        while at < len(ends) and ends[at] <= start:
            at += 1
        end = ends[at] if at < len(ends) else length
        if end - start >= coarse:
            anchors.append(fine[multiple * (depth + 1) - 1])
            continue
        stop = ends[at + 1] if at + 1 < len(ends) else length
        deepest = min(len(fine), stop // block)
        if deepest > depth * multiple:
            anchors.append(fine[deepest - 1])
        else:  # less than a logged block past the depth: the prefix and where it stops
            prefix = fine[depth * multiple - 1] if depth else record.seed
            anchors.append(xxhash.xxh3_64_intdigest(stop.to_bytes(8, "little"), prefix))
    return tuple(anchors)


def fixed_key_digest(record: TrafficRecord, prefix_length: int) -> int:
    """What SageMaker's key (the first ``prefix_length`` characters, salted) tells apart:
    the router's own digest where it logged one for this ``prefix_length``; otherwise the
    hash of the deepest whole block within ``prefix_length``, or of the whole prompt when
    the prompt is no longer than that."""
    if record.fixed is not None and record.fixed[1] == prefix_length:
        return record.fixed[0]
    if record.chars <= prefix_length:
        return record.whole
    depth = min(len(record.hashes), prefix_length // record.block_bytes)
    return record.hashes[depth - 1] if depth else record.seed
