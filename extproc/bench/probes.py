"""What the long-run benchmarks read off running processes: resident memory from /proc,
and Prometheus samples (labelled ones too) from a /metrics endpoint."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.local import LocalStack
from extproc.stack.processes import wait_until

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


def by_host(samples: Samples, name: str) -> dict[str, float]:
    """``name``'s samples by their ``host`` label."""
    return {
        dict(labels)["host"]: value
        for (sample, labels), value in samples.items()
        if sample == name and "host" in dict(labels)
    }


def placement_weights(stack: LocalStack) -> dict[str, float]:
    """The control plane's placement weights (cache pressure), by host address."""
    return by_host(scrape(stack.control_plane_metrics_url), "prefix_router_cp_placement_weight")


def wait_for_precise(stack: LocalStack, replicas: int, hosts: int, timeout_s: float = 30) -> None:
    """Until each of the first ``replicas`` routers reads ``hosts`` engines' KV events."""

    def precise(replica: int) -> float:
        samples = scrape(stack.replica_metrics_url(replica))
        return samples.get(("prefix_router_kv_events_hosts", (("state", "precise"),)), 0.0)

    wait_until(
        lambda: all(precise(r) == hosts for r in range(replicas)),
        timeout_s,
        f"{replicas} router replica(s) reading {hosts} engines' KV events",
    )


def wait_for_idle_pressure(stack: LocalStack, timeout_s: float = 120.0) -> None:
    """Wait until no host's cache pressure steers placement (every weight is 1): the
    traffic of a run before, even one that bypassed the routers, has died away."""

    def idle() -> bool:
        try:
            return all(weight == 1.0 for weight in placement_weights(stack).values())
        except OSError:  # the control plane did not answer this time
            return False

    wait_until(
        idle, timeout_s, "the cache pressure of earlier traffic to die away", stack.control_plane
    )


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        # The command name may hold spaces; the fields after its closing parenthesis don't.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
