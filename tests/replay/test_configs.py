"""The grid of configurations: each setting varied only where its strategy reads it, and
every bad value named."""

import pytest

from extproc.errors import ConfigError, ReplayError
from extproc.replay.configs import (
    FIXED,
    LEAST_OUTSTANDING,
    PREFIX_AWARE,
    RANDOM,
    STRATEGIES,
    Grid,
    ReplayConfig,
    check_block_sizes,
)


def test_each_setting_is_varied_only_where_its_strategy_reads_it():
    grid = Grid(
        strategies=STRATEGIES,
        instances=(4, 8),
        cache_tokens=(64_000,),
        concurrency_thresholds=(8, 32),
        block_bytes=(256, 512, 1024),
        prefix_lengths=(2048, 8192),
    )
    configs = grid.configs()
    per_fleet = 1 + 1 + 3 * 2 + 2 * 2  # RANDOM, LOR, PREFIX_AWARE, fixed
    assert len(configs) == 2 * per_fleet == len(set(configs))
    assert [c.instances for c in configs] == [4] * per_fleet + [8] * per_fleet
    for config in configs:
        assert (config.block_bytes is not None) == (config.strategy == PREFIX_AWARE)
        assert (config.prefix_length is not None) == (config.strategy == FIXED)
        assert (config.concurrency_threshold is not None) == (
            config.strategy in (PREFIX_AWARE, FIXED)
        )
    assert configs[0].label == RANDOM
    labels = {c.label for c in configs}
    assert "PREFIX_AWARE, block 512, threshold 8" in labels
    assert "PREFIX_AWARE-fixed, prefix 2048, threshold 32" in labels
    assert LEAST_OUTSTANDING in labels


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"strategies": ("ROUND_ROBIN",)}, "strategies"),
        ({"instances": (0,)}, "instances"),
        ({"instances": ()}, "instances"),
        ({"cache_tokens": (-5,)}, "cache_tokens"),
        ({"concurrency_thresholds": (1025,)}, "concurrency_thresholds"),
        ({"block_bytes": (0,)}, "block_bytes"),
        ({"prefix_lengths": (0,)}, "prefix_lengths"),
    ],
)
def test_a_bad_value_is_refused_by_name(changes, field):
    values = {"strategies": (RANDOM,), "instances": (7,), "cache_tokens": (1000,), **changes}
    with pytest.raises(ConfigError) as refused:
        Grid(**values)
    assert refused.value.field == field


def test_block_sizes_replay_coarser_than_the_log_never_finer():
    fine = ReplayConfig(PREFIX_AWARE, 7, 1000, 32, block_bytes=256)
    check_block_sizes([fine], 64)
    check_block_sizes([ReplayConfig(RANDOM, 7, 1000)], 512)
    with pytest.raises(ReplayError, match="256 is not a multiple of the log's block size 512"):
        check_block_sizes([fine], 512)
