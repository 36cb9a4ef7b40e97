"""The harness's one reader of Prometheus text: the samples at a /metrics endpoint (our
routers', the control plane's, the simulators', vLLM's), parsed by prometheus_client.

httpx and prometheus_client only: the local stack (``prefix-router up``) runs on a base
install."""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack import http_client

Labels = tuple[tuple[str, str], ...]
Samples = Mapping[tuple[str, Labels], float]


def parse(text: str) -> Samples:
    """Every sample of Prometheus text, keyed by (name, sorted labels)."""
    samples: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def scrape(url: str, timeout_s: float = 2.0) -> Samples:
    """Every sample at a Prometheus endpoint, keyed by (name, sorted labels); raises
    ``httpx.HTTPError`` when the endpoint does not answer, or answers other than 2xx."""
    return parse(http_client.get(url, timeout_s).content.decode())


def scrape_metric(url: str, name: str) -> float | None:
    """The value of the unlabelled sample ``name`` at a Prometheus endpoint; None when the
    endpoint does not answer or has no such sample."""
    try:
        samples = scrape(url)
    except httpx.HTTPError:  # not up yet, not an HTTP server, or not serving /metrics
        return None
    return samples.get((name, ()))


def total(samples: Samples, name: str) -> float:
    """The sum of ``name`` over all its label sets (0 when absent)."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


def series(samples: Samples, name: str) -> int:
    """How many label sets ``name`` has: the size of the state behind a labelled gauge."""
    return sum(1 for sample, _ in samples if sample == name)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples by their ``label`` label (those without it left out)."""
    return {
        dict(labels)[label]: value
        for (sample, labels), value in samples.items()
        if sample == name and label in dict(labels)
    }


def by_host(samples: Samples, name: str) -> dict[str, float]:
    """``name``'s samples by their ``host`` label."""
    return by_label(samples, name, "host")
