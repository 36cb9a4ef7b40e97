"""What the long-run benchmarks read off running processes: resident memory from /proc,
and Prometheus samples (labelled ones too) from a /metrics endpoint."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` (VmRSS in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid} (a zombie?)")


def scrape(url: str, timeout_s: float = 2.0) -> Samples:
    """Every sample at a Prometheus endpoint, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str) -> float:
    """The sum of ``name`` over all its label sets (0 when absent)."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


def series(samples: Samples, name: str) -> int:
    """How many label sets ``name`` has: the size of the state behind a labelled gauge."""
    return sum(1 for sample, _ in samples if sample == name)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        # The command name may hold spaces; the fields after its closing parenthesis don't.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
