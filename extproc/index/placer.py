"""PREFIX_AWARE by longest match, one request at a time, over the producers' state.

The router and ``prefix-router replay`` place a prompt the same way: look the prompt up in
the prefix index, read its heat from the popularity counts, decide (``decide_prefix``,
pure), then record where it went in the index, the popularity counts and the pending
prefill. This module is that sequence and nothing else: no metrics, no logging, no clock
(``now`` is given), so a replay runs the router's exact decisions at its own pace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.index.popularity import PrefixPopularity, heat_of
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import PrefixIndex
from extproc.picker.affinity import LoadPolicy, PrefixHeat, decide_prefix
from extproc.picker.blocks import PrefixLookup, PromptBlocks
from extproc.picker.decide import Decision
from extproc.picker.hosts import HostSet


@dataclass(frozen=True, slots=True)
class LongestPlacement:
    decision: Decision
    lookup: PrefixLookup
    heat: PrefixHeat
    # Bytes of the prompt the chosen host holds, by the index: whole blocks, and where its
    # engine's events are read, the start of the block the match stops in (tail_bytes).
    matched_bytes: int


def place_longest(
    blocks: PromptBlocks,
    hosts: HostSet,
    loads: Mapping[str, float],
    weights: Mapping[str, float],
    policy: LoadPolicy,
    hot_prefix_factor: float,
    failover: int,
    index: PrefixIndex,
    popularity: PrefixPopularity,
    prefill: PendingPrefill | None,
    now: float,
) -> LongestPlacement:
    """Decide where ``blocks`` goes among ``hosts`` (those serving its model), then record
    it: the index learns the chosen host holds it, the popularity counts it, and the
    chosen host's prefill queue grows by what it lacks."""
    lookup = index.lookup(blocks, hosts.addresses)
    heat = heat_of(popularity, blocks, len(hosts), hot_prefix_factor)
    decision = decide_prefix(
        lookup,
        heat,
        hosts,
        loads,
        weights,
        policy,
        failover,
        prefill.snapshot(now) if prefill is not None else None,
    )
    index.record(decision.primary, lookup)
    popularity.observe_prompt(blocks)
    depth = lookup.depth_on(decision.primary)
    matched = depth * blocks.block_bytes + index.tail_bytes(decision.primary, blocks, depth)
    if prefill is not None and blocks.length:
        prefill.add(decision.primary, blocks.length - matched, now)
    return LongestPlacement(decision, lookup, heat, matched)
