"""The configurations a replay compares: strategies and their settings, on fleets.

A configuration is a routing choice (``strategy``: RANDOM, LEAST_OUTSTANDING_REQUESTS,
PREFIX_AWARE by longest match, or PREFIX_AWARE-fixed, SageMaker's fixed-length key) with
the settings that strategy reads, on a fleet of ``instances`` engines of
``cache_tokens`` each. The grid is the product of the values asked for, each setting
varied only where the strategy reads it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.errors import ConfigError, ReplayError

RANDOM = "RANDOM"
LEAST_OUTSTANDING = "LEAST_OUTSTANDING_REQUESTS"
PREFIX_AWARE = "PREFIX_AWARE"
FIXED = "PREFIX_AWARE-fixed"
STRATEGIES = (RANDOM, LEAST_OUTSTANDING, PREFIX_AWARE, FIXED)
# Strategies that overflow at concurrency_threshold.
THRESHOLDED = (PREFIX_AWARE, FIXED)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    strategy: str
    instances: int
    cache_tokens: int
    # PREFIX_AWARE and PREFIX_AWARE-fixed.
    concurrency_threshold: int | None = None
    # PREFIX_AWARE: the block size, in bytes (a multiple of the log's).
    block_bytes: int | None = None
    # PREFIX_AWARE-fixed: the key's length, in characters.
    prefix_length: int | None = None

    @property
    def label(self) -> str:
        parts = [self.strategy]
        if self.block_bytes is not None:
            parts.append(f"block {self.block_bytes}")
        if self.prefix_length is not None:
            parts.append(f"prefix {self.prefix_length}")
        if self.concurrency_threshold is not None:
            parts.append(f"threshold {self.concurrency_threshold}")
        return ", ".join(parts)

    @property
    def fleet(self) -> tuple[int, int]:
        return self.instances, self.cache_tokens


@dataclass(frozen=True, slots=True)
class Grid:
    strategies: tuple[str, ...]
    instances: tuple[int, ...]
    cache_tokens: tuple[int, ...]
    concurrency_thresholds: tuple[int, ...] = (32,)
    block_bytes: tuple[int, ...] = (512,)
    prefix_lengths: tuple[int, ...] = (8192,)

    def __post_init__(self) -> None:
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ConfigError("strategies", strategy, ", ".join(STRATEGIES))
        _positive("instances", self.instances)
        _positive("cache_tokens", self.cache_tokens)
        _positive("concurrency_thresholds", self.concurrency_thresholds, high=1024)
        _positive("block_bytes", self.block_bytes)
        _positive("prefix_lengths", self.prefix_lengths)

    def configs(self) -> list[ReplayConfig]:
        """Every configuration, fleets outermost."""
        configs = []
        for instances, cache in itertools.product(self.instances, self.cache_tokens):
            for strategy in self.strategies:
                thresholds: Sequence[int | None] = (
                    self.concurrency_thresholds if strategy in THRESHOLDED else (None,)
                )
                blocks: Sequence[int | None] = (
                    self.block_bytes if strategy == PREFIX_AWARE else (None,)
                )
                lengths: Sequence[int | None] = (
                    self.prefix_lengths if strategy == FIXED else (None,)
                )
                for block, length, threshold in itertools.product(blocks, lengths, thresholds):
                    configs.append(
                        ReplayConfig(strategy, instances, cache, threshold, block, length)
                    )
        return configs


def check_block_sizes(configs: Sequence[ReplayConfig], log_block_bytes: int) -> None:
    """Block sizes must be whole multiples of the log's: a chain can be replayed coarser,
    never finer."""
    for config in configs:
        size = config.block_bytes
        if size is not None and size % log_block_bytes:
            raise ReplayError(
                f"block size {size} is not a multiple of the log's block size "
                f"{log_block_bytes}: record with a smaller block_bytes to replay it"
            )


def _positive(name: str, values: tuple[int, ...], high: int | None = None) -> None:
    bound = f"integers 1-{high}" if high is not None else "integers of at least 1"
    if not values:
        raise ConfigError(name, values, f"one or more {bound}")
    for value in values:
        if value < 1 or (high is not None and value > high):
            raise ConfigError(name, value, bound)
