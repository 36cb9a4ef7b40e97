"""The routing paths the fleet benchmark compares: ours (Envoy + the router, one config
each), Envoy's own ring_hash, and the peers (vllm-router, smg) when installed."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from extproc.bench.probes import wait_for_precise
from extproc.stack.bootstrap import BootstrapParams, logs_completions
from extproc.stack.processes import ManagedProcess, free_ports, wait_until

if TYPE_CHECKING:
    from extproc.bench.fleet_lifecycle import Fleet

OUR_STRATEGIES = ("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE")
# PREFIX_AWARE with overflow switched off: no concurrency limit worth the name, no balance
# bound. The hot-spot workload compares it with the default.
NO_OVERFLOW = "PREFIX_AWARE-no-overflow"
# SageMaker's behaviour: a hash of the first prefix_length characters.
FIXED = "PREFIX_AWARE-fixed"
# The default, with two router replicas that Envoy spreads the ext_proc streams over.
TWO_REPLICAS = "PREFIX_AWARE-two-replicas"
FOUR_REPLICAS = "PREFIX_AWARE-four-replicas"
# The same without the engines' KV events: each replica knows only its own decisions.
APPROXIMATE = "PREFIX_AWARE-approximate"
TWO_REPLICAS_APPROXIMATE = "PREFIX_AWARE-two-replicas-approximate"
FOUR_REPLICAS_APPROXIMATE = "PREFIX_AWARE-four-replicas-approximate"
# The replica comparison (``bench replicas``): 1, 2 and 4 replicas, with events and without.
REPLICA_PATHS = (
    "PREFIX_AWARE",
    TWO_REPLICAS,
    FOUR_REPLICAS,
    APPROXIMATE,
    TWO_REPLICAS_APPROXIMATE,
    FOUR_REPLICAS_APPROXIMATE,
)
# The default behind an Envoy that streams the body: one answer, a stream that ends with
# the decision, and in-flight counts from Envoy's access log. The hot spot compares it.
STREAMED = "PREFIX_AWARE-streamed"
# The default but for stream_end: decision (buffered bodies): each ext_proc stream ends with
# the decision, and the router learns that a request is done from Envoy's access log
# (``completion_log``), or, without the log, from the load feed's estimate alone.
STREAM_END_DECISION = "PREFIX_AWARE-stream-end-decision"
STREAM_END_DECISION_NO_LOG = "PREFIX_AWARE-stream-end-decision-no-log"
OUR_PATHS: dict[str, dict[str, Any]] = {
    **{strategy: {"routing_strategy": strategy} for strategy in OUR_STRATEGIES},
    FIXED: {"routing_strategy": "PREFIX_AWARE", "prefix_match": "fixed"},
    TWO_REPLICAS: {"routing_strategy": "PREFIX_AWARE"},
    FOUR_REPLICAS: {"routing_strategy": "PREFIX_AWARE"},
    APPROXIMATE: {"routing_strategy": "PREFIX_AWARE", "kv_events": False},
    TWO_REPLICAS_APPROXIMATE: {"routing_strategy": "PREFIX_AWARE", "kv_events": False},
    FOUR_REPLICAS_APPROXIMATE: {"routing_strategy": "PREFIX_AWARE", "kv_events": False},
    STREAMED: {"routing_strategy": "PREFIX_AWARE"},
    STREAM_END_DECISION: {"routing_strategy": "PREFIX_AWARE", "stream_end": "decision"},
    STREAM_END_DECISION_NO_LOG: {"routing_strategy": "PREFIX_AWARE", "stream_end": "decision"},
    NO_OVERFLOW: {
        "routing_strategy": "PREFIX_AWARE",
        "concurrency_threshold": 1024,
        "balance_factor": None,
    },
}
REPLICAS = {
    TWO_REPLICAS: 2,
    FOUR_REPLICAS: 4,
    TWO_REPLICAS_APPROXIMATE: 2,
    FOUR_REPLICAS_APPROXIMATE: 4,
}
# Paths behind an Envoy of their own: the stack's bootstrap with these changes (the rest
# run behind the stack's Envoy: buffered-partial bodies, no completion log).
ENVOY_CHANGES: dict[str, dict[str, Any]] = {
    STREAMED: {"body_mode": "streamed"},
    STREAM_END_DECISION: {"completion_log": True},
}
RING_HASH = "envoy-ring-hash"
PEERS = {
    "vllm-router-cache-aware": ("vllm-router", "cache_aware"),
    "vllm-router-consistent-hash": ("vllm-router", "consistent_hash"),
    "smg-cache-aware": ("smg", "cache_aware"),
}
SESSION_HEADER = "x-session-id"


def envoy_changes(path: str) -> BootstrapParams:
    """The bootstrap settings of ``path``'s Envoy that its own changes decide (the rest are
    the stack's, which these defaults stand for)."""
    return replace(BootstrapParams(), **ENVOY_CHANGES.get(path, {}))


def our_paths_document(paths: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each of our paths in ``paths``: the router settings it runs with, its replicas, and
    the body mode of the Envoy in front of it and whether it logs completions."""
    document = {}
    for path in paths:
        if path in OUR_PATHS:
            envoy = envoy_changes(path)
            document[path] = {
                "settings": dict(OUR_PATHS[path]),
                "replicas": REPLICAS.get(path, 1),
                "body_mode": envoy.body_mode,
                "completion_log": logs_completions(envoy),
            }
    return document


def _answers_chat(url: str) -> bool:
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def start_peer(fleet: Fleet, name: str) -> str | None:
    """Start peer ``name`` in front of the fleet; its base URL, or None if not installed."""
    binary, policy = PEERS[name]
    # Installed beside this Python (the bench extra), or anywhere on PATH.
    beside = Path(sys.executable).parent / binary
    path = str(beside) if beside.exists() else shutil.which(binary)
    if path is None:
        return None
    port, metrics_port = free_ports(2)
    argv = [path, *(["launch"] if binary == "smg" else [])]
    argv += [
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[f"http://{a}" for a in fleet.addresses],
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
    ]  # fmt: skip
    process = fleet.adopt(ManagedProcess(name, argv, fleet.work / f"{name}.log").start())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers_chat(url), 60, name, process)
    return url


def reads_events(path: str) -> bool:
    """Whether ``path``'s routers read the engines' KV events (ours, unless set off)."""
    return path in OUR_PATHS and OUR_PATHS[path].get("kv_events", True)


def path_url(fleet: Fleet, path: str) -> str | None:
    """Switch to ``path`` (our router by config hot reload; a peer by starting it) and
    return its base URL; None when the peer is not installed."""
    stack = fleet.stack
    assert stack is not None
    if path in OUR_PATHS:
        stack.write_router_config(**OUR_PATHS[path])
        replicas = REPLICAS.get(path, 1)
        stack.restart_routers(replicas)
        if reads_events(path):
            wait_for_precise(stack, replicas, len(fleet.addresses))
        if path in ENVOY_CHANGES:
            url, admin_url = fleet.path_envoys[path]
            if logs_completions(envoy_changes(path)):
                stack.open_completion_logs(url=url, admin_url=admin_url)
            return url
        return stack.url
    if path == RING_HASH:
        return fleet.ring_hash_url
    if path in PEERS:
        return start_peer(fleet, path)
    raise ValueError(f"unknown path {path!r}")
