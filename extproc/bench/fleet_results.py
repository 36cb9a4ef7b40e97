"""What one routing path measured, as run and as stored: the dataclasses are written to
the report's JSON with ``asdict`` and read back with ``path_result``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from extproc.bench.loadgen import RequestOutcome


@dataclass
class ClosedLoopResult:
    """A saturation run: requests completed per second of model time."""

    concurrency: int
    completed: int
    failed: int
    requests_per_s: float
    tokens_per_s: float
    hit_rate: float
    ttft_p50_ms: float


@dataclass
class PathResult:
    path: str
    outcomes: list[RequestOutcome]
    wall_s: float
    time_scale: float
    hit_rate: float
    overflow_rate: float | None = None
    skipped: str | None = None
    shares: dict[str, float] = field(default_factory=dict)
    overhead_ms: float | None = None  # p50 added over the direct call, zero-latency backend
    # The prefix index's own estimate of the hit rate (matched / prompt bytes), ours only.
    index_estimate: float | None = None
    closed_loop: ClosedLoopResult | None = None
    # Every probe pair's difference (routed minus direct, ms), when probes ran.
    overhead_pairs_ms: list[float] | None = None

    def ttfts_ms(self) -> list[float]:
        return sorted(o.ttft_s * 1000 / self.time_scale for o in self.outcomes if o.ok and o.ttft_s)

    def percentile(self, q: float) -> float:
        values = self.ttfts_ms()
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def failures(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    @property
    def requests_per_s(self) -> float:
        done = sum(o.ok for o in self.outcomes)
        return done / (self.wall_s / self.time_scale) if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(o.output_tokens for o in self.outcomes if o.ok)
        return tokens / (self.wall_s / self.time_scale) if self.wall_s else 0.0


def path_result(stored: dict[str, Any]) -> PathResult:
    """A PathResult from its stored form (``asdict`` of one, read back from JSON)."""
    fields = dict(stored)
    fields["outcomes"] = [RequestOutcome(**o) for o in fields["outcomes"]]
    closed = fields.pop("closed_loop", None)
    result = PathResult(**fields)
    result.closed_loop = ClosedLoopResult(**closed) if closed else None
    return result
