"""Replay a traffic log for every configuration of a grid, in one pass over the log.

The log is streamed (``RecordReader``): each record is parsed once and offered to every
configuration's ``Replayer`` in turn, so memory holds the configurations' state (their
caches and indexes), never the log.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.adapter.traffic_log import RecordReader, log_files
from extproc.config import RouterConfig
from extproc.errors import ReplayError
from extproc.replay.configs import Grid, ReplayConfig, check_block_sizes
from extproc.replay.replayer import (
    DRAWN,
    DRAWS,
    Replayer,
    ReplayResult,
    ServiceModel,
    mean_result,
)


@dataclass
class ReplayRun:
    records: int
    # Lines that were not well-formed records, and records of another block size than
    # the log's first (the router's settings changed while it logged).
    skipped: int
    other_block_size: int
    log_block_bytes: int
    # Seconds from the first record to the last.
    span_s: float
    # CPU seconds the replay took (parsing and every configuration).
    cpu_s: float
    results: list[ReplayResult]

    # Requests replayed, over every configuration and draw.
    decisions: int = 0

    @property
    def decisions_per_cpu_s(self) -> float:
        """Requests replayed a CPU second, over every configuration and draw."""
        return self.decisions / max(self.cpu_s, 1e-9)


def replay(
    path: Path,
    grid: Grid | Sequence[ReplayConfig],
    router: RouterConfig | None = None,
    service: ServiceModel | None = None,
    limit: int | None = None,
    hosts: Sequence[str] = (),
) -> ReplayRun:
    """Replay the log at ``path`` (with its rotated files, oldest first) for every
    configuration of ``grid`` (or those given); ``limit`` stops after that many records.
    ``hosts``: the real fleet's addresses, for the configurations of that many instances."""
    router = router or RouterConfig()
    service = service or ServiceModel()
    if not log_files(path):
        raise ReplayError(f"no traffic log at {path}")
    started = time.process_time()
    reader = RecordReader(path)
    records = iter(reader)
    first = next(records, None)
    if first is None:
        raise ReplayError(f"{path}: no traffic-log records ({reader.skipped} lines skipped)")
    block = first.block_bytes
    configs = grid.configs() if isinstance(grid, Grid) else list(grid)
    check_block_sizes(configs, block)
    # Each configuration's replayers: one, or one per draw for a strategy that draws.
    groups = [
        [
            Replayer(c, block, router, service, seed=seed, hosts=hosts)
            for seed in range(1, 1 + (DRAWS if c.strategy in DRAWN else 1))
        ]
        for c in configs
    ]
    offers = [replayer.offer for group in groups for replayer in group]
    count = other = 0
    last = first.t
    for record in itertools.chain((first,), records):
        if record.block_bytes != block:
            other += 1
            continue
        count += 1
        last = max(last, record.t)
        for offer in offers:
            offer(record)
        if limit is not None and count >= limit:
            break
    return ReplayRun(
        records=count,
        skipped=reader.skipped,
        other_block_size=other,
        log_block_bytes=block,
        span_s=last - first.t,
        cpu_s=time.process_time() - started,
        decisions=count * len(offers),
        results=[mean_result([replayer.result() for replayer in group]) for group in groups],
    )
