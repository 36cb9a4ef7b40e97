"""Immutable records the control plane's producers write and its consumers read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostHealth:
    """What active health checking knows of one host."""

    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Model ids the host serves (base models and LoRA adapters), from /v1/models.
    models: tuple[str, ...] = ()
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class HostLoad:
    """One scrape of a vLLM host's /metrics, summed over its label sets."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # KV cache size in tokens (num_gpu_blocks x block_size of vllm:cache_config_info);
    # 0 when the host does not publish it.
    cache_capacity_tokens: float = 0.0
    # Prompt tokens a second the host takes in, smoothed by the control plane (cache
    # pressure); 0 until two scrapes have been seen.
    prompt_tokens_per_s: float = 0.0
    # The weight new prefixes are placed with (control/rates.py); 1 for every host of a
    # fleet whose pressure is even.
    placement_weight: float = 1.0
    # time.monotonic() of the scrape in the control plane, for the feed's age.
    scraped_at: float = 0.0

    @property
    def outstanding(self) -> float:
        return self.running + self.waiting
