"""Envoy, the router, the control plane and simulators, each in its own container.

Every container uses the host network and loopback addresses, as the CI engine runs with
its bridge off. Configs are rendered to a directory mounted read-only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx
import yaml
from testcontainers.core.container import DockerContainer

from extproc.stack import prometheus
from extproc.stack.bootstrap import BootstrapParams, render
from extproc.stack.envoy_admin import envoy_hosts, healthy_hosts
from extproc.stack.local import INSTANT_PREFILL, simulated_backends
from extproc.stack.processes import free_ports, http_ok, wait_until

LABEL = "envoy-prefix-router.test"
_serial = itertools.count()
READY_TIMEOUT_S = 60
THRESHOLD = 2


def document(n: int) -> str:
    """A prompt whose first 4,096 characters only n tells apart: tests/prompts.py's, which
    this package cannot import (it is a package of its own)."""
    return f"document {n}: " + "the quick brown fox jumps over the lazy dog " * 200


def join(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def docker_client() -> docker.DockerClient:
    return docker.from_env(timeout=30)


@dataclass(frozen=True)
class ImageTags:
    router: str
    sim: str
    envoy: str

    @classmethod
    def for_tag(cls, tag: str) -> ImageTags:
        return cls(
            router=f"envoy-prefix-router:{tag}",
            sim=f"envoy-prefix-router-sim:{tag}",
            envoy=f"envoy-prefix-router-envoy:{tag}",
        )


def wait_for(check: Callable[[], object], what: str, timeout: float = READY_TIMEOUT_S) -> None:
    """extproc/stack/processes.py's wait_until, polling every 0.2 s: a container that is
    not listening yet (OSError, httpx.HTTPError) counts as not ready."""
    wait_until(check, timeout, what, interval_s=0.2, ignoring=(OSError, httpx.HTTPError))


def metric(url: str, name: str, **labels: str) -> float | None:
    """The sample ``name`` with exactly ``labels``; None when the endpoint does not answer
    or has no such sample."""
    try:
        samples = prometheus.scrape(url)
    except httpx.HTTPError:  # not up yet
        return None
    return samples.get((name, tuple(sorted(labels.items()))))


class ContainerStack:
    """Three simulator containers, the control plane, the router and Envoy."""

    def __init__(self, images: ImageTags, config_dir: Path) -> None:
        self.images = images
        self.config_dir = config_dir
        config_dir.chmod(0o755)  # the images run as an unprivileged user
        listen, admin, router, router_metrics, xds, xds_metrics = free_ports(6)
        self.listen = ("127.0.0.1", listen)
        self.admin = ("127.0.0.1", admin)
        self.router_address = ("127.0.0.1", router)
        self.router_metrics = ("127.0.0.1", router_metrics)
        self.control_plane = ("127.0.0.1", xds)
        self.control_plane_metrics = ("127.0.0.1", xds_metrics)
        self.backends = simulated_backends(3)
        self.containers: dict[str, DockerContainer] = {}

    # ---- addresses
    @property
    def url(self) -> str:
        return f"http://{self.listen[0]}:{self.listen[1]}"

    @property
    def router_metrics_url(self) -> str:
        return f"http://{self.router_metrics[0]}:{self.router_metrics[1]}/metrics"

    @property
    def fleet(self) -> set[str]:
        return {f"{h}:{p}" for h, p in self.backends}

    # ---- lifecycle
    def _write(self, name: str, content: str) -> Path:
        path = self.config_dir / name
        path.write_text(content)
        path.chmod(0o644)
        return path

    def _run(self, name: str, image: str, command: list[str], **env: str) -> DockerContainer:
        container = (
            DockerContainer(image, name=f"prt-{os.getpid()}-{name}-{next(_serial)}")
            .with_command(command)
            .with_volume_mapping(str(self.config_dir), "/etc/prefix-router", "ro")
            .with_kwargs(network_mode="host", labels={LABEL: name})
        )
        for key, value in env.items():
            container.with_env(key, value)
        container.start()
        self.containers[name] = container
        return container

    def stop_container(self, name: str) -> None:
        container = self.containers.pop(name)
        container.stop()  # stops and removes

    def start_sims(self) -> None:
        for index, (host, port) in enumerate(self.backends):
            self._run(
                f"sim-{index}",
                self.images.sim,
                ["sim", "--address", f"{host}:{port}", "--ttft-ms", "0", "--itl-ms", "20"],
                PREFIX_ROUTER_HEALTH_URL=f"http://{host}:{port}/health",
            )
        for host, port in self.backends:
            wait_for(lambda h=host, p=port: http_ok(f"http://{h}:{p}/health"), f"sim {host}")

    def start_control_plane(self) -> None:
        config = {
            "listen": join(self.control_plane),
            "metrics_listen": join(self.control_plane_metrics),
            "hosts": sorted(self.fleet),
            "health": {"interval_s": 0.5, "unhealthy_threshold": 2, "healthy_threshold": 1},
            # Placement by hash alone, so that a restarted router's placements can be
            # compared with the first router's exactly (cache pressure moves new prefixes).
            "load_feed": {"pressure_factor": None},
        }
        self._write("control-plane.yaml", yaml.safe_dump(config))
        metrics = f"http://{join(self.control_plane_metrics)}/metrics"
        self._run(
            "control-plane",
            self.images.router,
            ["control-plane", "--config", "/etc/prefix-router/control-plane.yaml"],
            PREFIX_ROUTER_HEALTH_URL=metrics,
        )
        wait_for(lambda: http_ok(metrics), "the control plane")

    def start_router(self, **settings: Any) -> None:
        config = {
            "routing_strategy": "PREFIX_AWARE",
            "concurrency_threshold": THRESHOLD,
            "prefix_length": 4096,
            **INSTANT_PREFILL,  # the simulators answer at once (--ttft-ms 0)
            # Placement is what these tests check; a loop the OS delays 0.2 s on a busy
            # 2-core machine would shed, placing by load (tests/reliability/stacks.py).
            "shed_lag_s": None,
            "control_plane": join(self.control_plane),
            "listen": join(self.router_address),
            "metrics_listen": join(self.router_metrics),
            **settings,
        }
        self._write("router.yaml", yaml.safe_dump(config))
        self._run(
            "router",
            self.images.router,
            ["router", "--config", "/etc/prefix-router/router.yaml"],
            PREFIX_ROUTER_HEALTH_URL=self.router_metrics_url,
        )
        wait_for(
            lambda: metric(self.router_metrics_url, "prefix_router_hosts") == len(self.backends),
            "the router to know the fleet",
        )
        if "envoy" in self.containers:
            self.wait_for_router_in_envoy()

    def start_envoy(self) -> None:
        params = BootstrapParams(
            listen=self.listen,
            admin=self.admin,
            routers=(self.router_address,),
            backends=self.backends,
            control_plane=self.control_plane,
        )
        self._write("envoy.yaml", render(params))
        self._run(
            "envoy",
            self.images.envoy,
            ["-c", "/etc/prefix-router/envoy.yaml", "--log-level", "warn", "--disable-hot-restart"],
        )
        admin = f"http://{join(self.admin)}"

        def ready() -> bool:
            if not http_ok(f"{admin}/ready"):
                return False
            return self.fleet <= envoy_hosts(admin, "vllm")

        wait_for(ready, "Envoy to serve with the whole fleet")
        self.wait_for_router_in_envoy()

    def wait_for_router_in_envoy(self) -> None:
        """Until Envoy's gRPC health check passes the router (else requests fail open)."""
        router = join(self.router_address)
        admin = f"http://{join(self.admin)}"
        wait_for(
            lambda: router in healthy_hosts(admin, "prefix_router"),
            f"Envoy's health checks to pass the router at {router}",
        )

    def __enter__(self) -> ContainerStack:
        try:
            self.start_sims()
            self.start_control_plane()
            self.start_router()
            self.start_envoy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in list(reversed(self.containers)):
            self.stop_container(name)

    def wait_idle(self) -> None:
        """Until no simulator runs a request, plus a few load-feed rounds: the feed (and
        with it overflow) then sees an idle fleet, so placements are the hash's own."""

        def running(host: str) -> float:
            samples = prometheus.scrape(f"http://{host}/metrics")
            return prometheus.total(samples, "vllm:num_requests_running")

        def load_rounds() -> float:
            # The control plane stamps each round's loads, so every round is an update.
            url = self.router_metrics_url
            return metric(url, "prefix_router_fleet_updates_total", kind="load") or 0.0

        wait_for(lambda: all(running(host) == 0 for host in self.fleet), "an idle fleet")
        # Two rounds, as one may have been scraped before the fleet went idle.
        rounds = load_rounds()
        wait_for(lambda: load_rounds() >= rounds + 2, "two load-feed rounds of an idle fleet")

    def logs(self, name: str) -> str:
        stdout, stderr = self.containers[name].get_logs()
        return (stdout + stderr).decode(errors="replace")
