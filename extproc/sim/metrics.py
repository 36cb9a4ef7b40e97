"""Per-instance Prometheus metrics under vLLM's names."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.sim.cache import CacheResult

# Every simulated request ends by hitting its max_tokens limit.
FINISHED_REASON = "length"

# vLLM's own buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class SimMetrics:
    """The vLLM metrics one simulated instance exports, in its own registry.

    A registry per instance keeps several instances in one process apart.
    """

    def __init__(
        self,
        model_name: str,
        kv_cache_usage: Callable[[], float],
        num_gpu_blocks: int = 0,
        block_size: int = 16,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model_name = model_name

        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests being served.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be served.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: 1 means full.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name).set_function(kv_cache_usage)
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in tokens.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prefill tokens processed.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Generation tokens produced.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._request_success = Counter(
            "vllm:request_success",
            "Successfully finished requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        ).labels(model_name=model_name, finished_reason=FINISHED_REASON)
        self._time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, in seconds.",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name=model_name)
        # vLLM's info-style gauge: always 1, the cache config in its labels.
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
            registry=self.registry,
        ).labels(
            block_size=str(block_size),
            num_gpu_blocks=str(num_gpu_blocks),
            enable_prefix_caching="True",
            engine="0",
        ).set(1)
        # Fixed timing has no queue: waiting stays 0 unless an engine is followed.
        self._waiting.set(0)

    def follow_engine(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the running and waiting gauges from an engine model at scrape time."""
        self._running.set_function(running)
        self._waiting.set_function(waiting)

    def request_started(self) -> None:
        self._running.inc()

    def request_ended(self) -> None:
        self._running.dec()

    def prompt_processed(self, result: CacheResult) -> None:
        self._prefix_queries.inc(result.query_tokens)
        self._prefix_hits.inc(result.hit_tokens)
        self._prompt_tokens.inc(result.query_tokens)

    def tokens_generated(self, count: int) -> None:
        self._generation_tokens.inc(count)

    def first_token(self, seconds: float) -> None:
        self._time_to_first_token.observe(seconds)

    def request_succeeded(self) -> None:
        self._request_success.inc()
