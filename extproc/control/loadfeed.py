"""The load feed: scrape each vLLM host's /metrics into a HostLoad.

`parse_vllm_metrics` is the pure core; `scrape` is the HTTP adapter and `LoadScraper`
runs rounds of scrapes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from extproc.control.model import HostLoad
from extproc.control.rounds import sleep_unless_stopped
from extproc.errors import RouterError
from extproc.http_client import host_client

log = structlog.get_logger("loadfeed")

# HostLoad field -> the vLLM sample names that feed it. Counters are exposed as
# `<name>_total`; older exporters (and untyped text) may drop the suffix, so both count.
_SUMMED_SAMPLES: Mapping[str, frozenset[str]] = {
    "running": frozenset({"vllm:num_requests_running"}),
    "waiting": frozenset({"vllm:num_requests_waiting"}),
    "prefix_cache_queries": frozenset(
        {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"}
    ),
    "prefix_cache_hits": frozenset({"vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"}),
}
# A fraction of one shared cache: summing label sets would exceed 1, so take the max.
_MAXED_SAMPLES: Mapping[str, frozenset[str]] = {
    "kv_cache_usage": frozenset({"vllm:kv_cache_usage_perc"}),
}
_FIELD_OF_SAMPLE = {
    name: field
    for table in (_SUMMED_SAMPLES, _MAXED_SAMPLES)
    for field, names in table.items()
    for name in names
}
# vLLM's cache config, an info-style gauge: one label set per engine, with the KV cache's
# num_gpu_blocks and block_size (tokens) among its labels.
_CACHE_CONFIG_SAMPLE = "vllm:cache_config_info"
# How much of a bad body goes into the error message.
_EXCERPT_CHARS = 120


def _cache_tokens(labels: Mapping[str, str]) -> float:
    """One engine's KV cache size in tokens, or 0 if the labels do not say."""
    try:
        blocks = float(labels.get("num_gpu_blocks", ""))
        block_size = float(labels.get("block_size", ""))
    except ValueError:  # "None" before the engine profiled its memory, or absent
        return 0.0
    if not (math.isfinite(blocks) and math.isfinite(block_size)) or blocks < 0:
        return 0.0
    return max(0.0, blocks * block_size)


class LoadFeedError(RouterError):
    """A host's /metrics could not be fetched or understood."""


@dataclass(frozen=True)
class LoadFeedPolicy:
    """How often the hosts are scraped and how long one scrape may take."""

    interval_s: float = 0.25
    timeout_s: float = 0.2

    def __post_init__(self) -> None:
        for field in ("interval_s", "timeout_s"):
            value = getattr(self, field)
            valid = isinstance(value, int | float) and not isinstance(value, bool)
            if not valid or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{field}={value!r}: allowed a finite number of seconds > 0")
        if self.timeout_s > self.interval_s:
            raise ValueError(
                f"timeout_s={self.timeout_s!r}: allowed (0, interval_s={self.interval_s!r}]"
            )


def parse_vllm_metrics(text: str, scraped_at: float) -> HostLoad:
    """The load in one /metrics body, summed over label sets (model_name, engine, ...), and
    the KV cache size that ``vllm:cache_config_info`` states.

    Metrics the body lacks count as 0. Raises LoadFeedError on text that is not the
    Prometheus exposition format or on a non-finite value of a metric used here.
    """
    totals = dict.fromkeys(_FIELD_OF_SAMPLE.values(), 0.0)
    cache_tokens = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _CACHE_CONFIG_SAMPLE:
                    # Engines of one server (data parallel) each have a cache of their own.
                    cache_tokens += _cache_tokens(sample.labels)
                    continue
                field = _FIELD_OF_SAMPLE.get(sample.name)
                if field is None:
                    continue
                if not math.isfinite(sample.value):
                    raise LoadFeedError(f"metric {sample.name} has non-finite value {sample.value}")
                if field in _MAXED_SAMPLES:
                    totals[field] = max(totals[field], sample.value)
                else:
                    totals[field] += sample.value
    except LoadFeedError:
        raise
    except Exception as exc:
        # The parser signals bad text with ValueError, and with others on odd input.
        excerpt = text[:_EXCERPT_CHARS]
        raise LoadFeedError(f"malformed Prometheus text ({exc}): {excerpt!r}") from exc
    return HostLoad(scraped_at=scraped_at, cache_capacity_tokens=cache_tokens, **totals)


async def scrape(
    client: httpx.AsyncClient,
    address: str,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> HostLoad:
    """GET http://{address}/metrics within `timeout_s`; raises LoadFeedError on any failure.

    The load is stamped with the moment the request was sent: routers count their own
    decisions made after it on top of it, since the scrape may not show them.
    """
    started = clock()
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.get(f"http://{address}/metrics")
        if not response.is_success:
            raise LoadFeedError(f"{address}/metrics answered HTTP {response.status_code}")
        text = _strict_text(response)
    except LoadFeedError:
        raise
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise LoadFeedError(f"{address}/metrics timed out after {timeout_s} s") from exc
    except Exception as exc:
        # httpx.HTTPError (connection, protocol, content decoding), InvalidURL, a body that
        # is not text: each is this host's failure, never the round's.
        raise LoadFeedError(f"{address}/metrics failed: {type(exc).__name__}: {exc}") from exc
    return parse_vllm_metrics(text, scraped_at=started)


def _strict_text(response: httpx.Response) -> str:
    """The body as text; raises UnicodeDecodeError where `response.text` would put U+FFFD
    in place of the bytes that are not of its charset (UTF-8 unless the header says)."""
    return response.content.decode(response.encoding or "utf-8")


class LoadScraper:
    """Scrapes a changing list of hosts in rounds; a failing host is left out of the round."""

    def __init__(
        self,
        policy: LoadFeedPolicy,
        clock: Callable[[], float] = time.monotonic,
        client_factory: Callable[[], httpx.AsyncClient] = host_client,
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._client_factory = client_factory
        # Open only while run() is; scrape_once() alone uses a client per round.
        self._client: httpx.AsyncClient | None = None
        # Scrapes that failed since construction, for the control plane's own metrics.
        self.failures = 0

    async def scrape_once(self, addresses: Iterable[str]) -> Mapping[str, HostLoad]:
        """Scrape every address concurrently; each costs at most its own timeout."""
        if self._client is not None:
            return await self._scrape_with(self._client, addresses)
        async with self._client_factory() as client:
            return await self._scrape_with(client, addresses)

    async def run(
        self,
        addresses: Callable[[], Iterable[str]],
        on_loads: Callable[[Mapping[str, HostLoad]], None],
        stop: asyncio.Event,
    ) -> None:
        """Scrape every `interval_s` and hand each round's loads to `on_loads` until `stop`."""
        loop = asyncio.get_running_loop()
        async with self._client_factory() as client:
            self._client = client
            try:
                while not stop.is_set():
                    round_started = loop.time()
                    # A round is bounded by timeout_s, so stop waits at most that long.
                    on_loads(await self._scrape_with(client, addresses()))
                    remaining = self._policy.interval_s - (loop.time() - round_started)
                    await sleep_unless_stopped(remaining, stop)
            finally:
                self._client = None

    async def _scrape_with(
        self, client: httpx.AsyncClient, addresses: Iterable[str]
    ) -> Mapping[str, HostLoad]:
        listed = list(dict.fromkeys(addresses))
        results = await asyncio.gather(
            *(scrape(client, address, self._policy.timeout_s, self._clock) for address in listed),
            return_exceptions=True,
        )
        loads: dict[str, HostLoad] = {}
        for address, result in zip(listed, results, strict=True):
            if isinstance(result, HostLoad):
                loads[address] = result
            elif isinstance(result, LoadFeedError):
                self.failures += 1
                log.debug("loadfeed.scrape_failed", address=address, error=str(result))
            else:
                raise result  # a bug or a cancellation, not a host failure
        return MappingProxyType(loads)
