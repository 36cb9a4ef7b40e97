"""Fleet-wide prefix-cache counters, read from each vLLM (or simulator) /metrics."""

from __future__ import annotations

from collections.abc import Iterable

import httpx

from extproc.control.loadfeed import parse_vllm_metrics


def prefix_counters(addresses: Iterable[str]) -> tuple[float, float]:
    """(queries, hits) summed over instances, in tokens."""
    queries = hits = 0.0
    for address in addresses:
        load = parse_vllm_metrics(httpx.get(f"http://{address}/metrics").text, 0.0)
        queries += load.prefix_cache_queries
        hits += load.prefix_cache_hits
    return queries, hits
