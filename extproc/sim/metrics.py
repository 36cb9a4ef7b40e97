"""Per-instance Prometheus metrics under vLLM's names."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.sim.cache import CacheResult

# Every simulated request ends by hitting its max_tokens limit.
FINISHED_REASON = "length"


class SimMetrics:
    """The vLLM metrics one simulated instance exports, in its own registry.

    A registry per instance keeps several instances in one process apart.
    """

    def __init__(self, model_name: str, kv_cache_usage: Callable[[], float]) -> None:
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
        # Export the waiting gauge at 0 until there is a queueing model.
        self._waiting.set(0)

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

    def request_succeeded(self) -> None:
        self._request_success.inc()
