"""The harness's one reader of Envoy's admin interface: its stats (``/stats?format=json``),
its clusters' hosts (``/clusters?format=json``) and its worker count (``/server_info``),
read as JSON. Each read raises ``httpx.HTTPError`` when Envoy does not answer, or answers
other than 2xx (extproc/stack/http_client.py).

Standard library and httpx only: the local stack (``prefix-router up``) runs on a base
install."""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from extproc.stack import http_client


def _get_json(url: str) -> Any:
    return json.loads(http_client.get(url, timeout_s=2).content)


def envoy_counters(admin_url: str, prefix: str) -> dict[str, float]:
    """Envoy's counters and gauges whose names start with ``prefix``, by the rest of the
    name (``envoy_counters(admin, "http.ingress.ext_proc.")["streams_started"]``)."""
    pattern = urllib.parse.quote("^" + re.escape(prefix))
    body = _get_json(f"{admin_url}/stats?format=json&filter={pattern}")
    values = {}
    # Counters and gauges are {"name", "value"}; histograms come as one {"histograms"}
    # entry, and text readouts have a string value: neither is a count.
    for stat in body.get("stats", []):
        name, value = stat.get("name"), stat.get("value")
        if (
            isinstance(name, str)
            and name.startswith(prefix)
            and isinstance(value, int)
            and not isinstance(value, bool)
        ):
            values[name[len(prefix) :]] = float(value)
    return values


def envoy_workers(admin_url: str) -> int:
    """Envoy's worker threads (its --concurrency: the machine's cores by default)."""
    return int(_get_json(f"{admin_url}/server_info")["command_line_options"]["concurrency"])


def _hosts(admin_url: str, cluster: str) -> list[dict[str, Any]]:
    """The host statuses of ``cluster`` on Envoy's /clusters page (none when Envoy has no
    such cluster)."""
    body = _get_json(f"{admin_url}/clusters?format=json")
    for status in body.get("cluster_statuses", []):
        if status.get("name") == cluster:
            hosts: list[dict[str, Any]] = status.get("host_statuses", [])
            return hosts
    return []


def _address(host: dict[str, Any]) -> str:
    """A host's address as Envoy's text pages write it: ip:port, or a Unix socket's path."""
    address = host["address"]
    if "pipe" in address:
        return str(address["pipe"]["path"])
    socket = address["socket_address"]
    return f"{socket['address']}:{socket.get('port_value', 0)}"


def _healthy(host: dict[str, Any]) -> bool:
    """Whether none of a host's health flags is set: what the text page shows as
    ``health_flags::healthy``. Envoy writes every boolean flag that is set (failed active
    or outlier check, pending removal, ...) and the EDS status (HEALTHY unless EDS said
    UNHEALTHY, DEGRADED or DRAINING)."""
    status = host.get("health_status", {})
    return status.get("eds_health_status") == "HEALTHY" and not any(
        value is True for value in status.values()
    )


def envoy_hosts(admin_url: str, cluster: str) -> set[str]:
    """Every address Envoy has in ``cluster``, whatever its health."""
    return {_address(host) for host in _hosts(admin_url, cluster)}


def healthy_hosts(admin_url: str, cluster: str) -> set[str]:
    """The addresses in ``cluster`` whose health flags are all clear (Envoy's "healthy")."""
    return {_address(host) for host in _hosts(admin_url, cluster) if _healthy(host)}
