"""Every default port of the stack, defined once.

Each process of ``prefix-router up`` (and of the commands it is made of) takes its default
address from here, so no two defaults can drift into each other: a router with
``--workers N`` listens on its gRPC and metrics ports + i, an endpoint picker with
``--workers N`` on its metrics port + i (its gRPC and health ports are one address every
worker binds), and those runs of ports must not reach another default. (They did: worker
1's metrics port, 9102 + 1, was the control plane's 9103, and the picker's worker 12 would
have taken 9090 + 12, the router's metrics port, until it moved to 9190. And the router's
gRPC port was gRPC's usual 50051, in the ephemeral range: in CI a client's connection held
50052 as its own port when ``up --workers 2`` started, and worker 1 could not bind it.)
``tests/test_ports.py`` checks every default and every worker's span against each other,
``tests/integration/test_up.py`` starts up's all at once, and
``tests/integration/test_epp_workers.py`` the picker's.

The endpoint picker's ports (9002, 9003, 9090) are the Inference Extension's contract, and
the KV-event ports (5557, 5558) are vLLM's; the rest are ours. Every one of them, with every
worker's, is below the kernel's ephemeral range (32768 and up), where a client's own port can
never take one first.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK = "127.0.0.1"
# The most router processes one ``--workers`` may start; each takes its own metrics port.
MAX_WORKERS = 64

ENVOY_LISTEN = 10000
ENVOY_ADMIN = 9901
# Past the router's metrics span (9190 + 63): 100 above it, as that is above the picker's.
ROUTER_GRPC = 9290
# Past the picker's metrics span (9090 + 63): 100 above it.
ROUTER_METRICS = 9190
CONTROL_PLANE_XDS = 18000
CONTROL_PLANE_METRICS = 18001
EPP_GRPC = 9002
EPP_HEALTH = 9003
EPP_METRICS = 9090
# Simulated backends listen on 127.0.0.11, .12, ... each on this port, and publish their
# KV events on the next two, as vLLM does (``--kv-events-config`` endpoints).
SIM_PORT = 8000
SIM_FIRST_HOST = 11
KV_EVENTS = 5557
KV_EVENTS_REPLAY = 5558


def loopback(port: int) -> str:
    """``127.0.0.1:port``: where a default listens."""
    return f"{LOOPBACK}:{port}"


def sim_host(index: int) -> str:
    """The loopback IP of simulated backend ``index`` (0-based)."""
    return f"127.0.0.{SIM_FIRST_HOST + index}"


# The fleet a generated bootstrap or gateway names when given none: ``up``'s three
# simulated backends on their default port.
DEFAULT_FLEET: tuple[tuple[str, int], ...] = tuple((sim_host(i), SIM_PORT) for i in range(3))


@dataclass(frozen=True, slots=True)
class DefaultPort:
    """A default port and the process that listens on it."""

    name: str
    port: int
    # Workers take this port + i, for i below the worker count (False: one port, shared
    # by every worker, or a process that has no workers).
    per_worker: bool = False

    def span(self, workers: int) -> range:
        """The ports it takes with ``workers`` router (or picker) processes."""
        return range(self.port, self.port + (workers if self.per_worker else 1))


# The ports on 127.0.0.1 (the simulators' are on addresses of their own).
DEFAULTS = (
    DefaultPort("envoy listener", ENVOY_LISTEN),
    DefaultPort("envoy admin", ENVOY_ADMIN),
    DefaultPort("router gRPC", ROUTER_GRPC, per_worker=True),
    DefaultPort("router metrics", ROUTER_METRICS, per_worker=True),
    DefaultPort("control plane xDS", CONTROL_PLANE_XDS),
    DefaultPort("control plane metrics", CONTROL_PLANE_METRICS),
    # ``epp --workers N``: every worker on the gRPC and health ports (SO_REUSEPORT).
    DefaultPort("endpoint picker gRPC", EPP_GRPC),
    DefaultPort("endpoint picker health", EPP_HEALTH),
    DefaultPort("endpoint picker metrics", EPP_METRICS, per_worker=True),
)
