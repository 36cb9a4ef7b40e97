"""What the index, the load policy and queued prefill read from a RouterConfig: one place
for the Router (``routing.py``) and shadow mode (``observers.py``), which build the same
models from the same settings."""

from __future__ import annotations

from extproc.config import RouterConfig
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import IndexSizing
from extproc.picker.affinity import LoadPolicy


def load_policy(config: RouterConfig) -> LoadPolicy:
    return LoadPolicy(
        config.concurrency_threshold,
        config.balance_factor,
        config.balance_min_in_flight,
        config.overload_cost,
    )


def pending_prefill_rate(config: RouterConfig) -> float | None:
    """Prompt bytes an engine prefills a second; None: queued prefill is not counted."""
    if config.prefill_tokens_per_s is None:
        return None
    return config.prefill_tokens_per_s * config.chars_per_token


def pending_prefill(config: RouterConfig) -> PendingPrefill | None:
    rate = pending_prefill_rate(config)
    return None if rate is None else PendingPrefill(rate)


def index_sizing(config: RouterConfig) -> IndexSizing:
    return IndexSizing(
        block_bytes=config.block_bytes,
        max_blocks=config.index_max_blocks,
        default_host_tokens=config.index_host_tokens,
        chars_per_token=config.chars_per_token,
    )
