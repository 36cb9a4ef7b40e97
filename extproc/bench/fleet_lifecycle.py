"""The fleet's lifecycle: the simulated instances (one process, one aiohttp app each), our
stack (Envoy, router replicas, control plane) and the ring_hash Envoy in front of them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import httpx

from extproc.bench import probes
from extproc.bench.fleet_options import (
    FleetBenchOptions,
    control_plane_settings,
    simulator_args,
    stack_router_settings,
)
from extproc.bench.fleet_paths import ENVOY_CHANGES, REPLICAS, SESSION_HEADER
from extproc.control.loadfeed import parse_vllm_metrics
from extproc.sim.options import SimOptions
from extproc.stack.local import LocalStack, StackSpec
from extproc.stack.processes import ManagedProcess, free_port, http_ok, wait_until


def reset_caches(
    addresses: Sequence[str], stack: LocalStack | None = None, followed: int | None = None
) -> None:
    """Wait for the instances to go idle, then empty their prefix caches and publish the
    resets (``publish_resets``). ``stack``: its routers read the engines' KV events (the
    path's do); return once each follows ``followed`` engines (all of ``addresses`` by
    default) and holds none of their blocks."""

    def idle() -> bool:
        loads = [parse_vllm_metrics(httpx.get(f"http://{a}/metrics").text, 0.0) for a in addresses]
        return all(load.running == 0 and load.waiting == 0 for load in loads)

    wait_until(idle, 120, "the simulators to go idle")
    probes.reset_caches(addresses, SimOptions.model, stack, followed)


class Fleet:
    """The simulated instances and our stack; ``stop`` ends every process started."""

    def __init__(self, options: FleetBenchOptions, work: Path) -> None:
        self.options = options
        self.work = work
        hosts = [f"127.0.0.{31 + i}" for i in range(options.instances + options.spare_instances)]
        port = free_port(hosts[0])
        self.all_addresses = [f"{h}:{port}" for h in hosts]  # every simulator started
        self.addresses = self.all_addresses[: options.instances]  # the fleet at first
        self.sim: ManagedProcess | None = None
        self.stack: LocalStack | None = None
        self.ring_hash_url: str | None = None
        self.ring_hash_admin_url: str | None = None
        # (URL, admin URL) of the Envoy in front of the routers for each other body mode.
        # The Envoys of paths with bootstrap changes of their own: URL and admin URL.
        self.path_envoys: dict[str, tuple[str, str]] = {}
        self._extra: list[ManagedProcess] = []

    def adopt(self, process: ManagedProcess) -> ManagedProcess:
        """Stop ``process`` with the fleet."""
        self._extra.append(process)
        return process

    def start(self) -> None:
        self._start_simulators()
        backends = tuple((a.split(":")[0], int(a.split(":")[1])) for a in self.addresses)
        spec = StackSpec.ephemeral(
            0,
            external_backends=backends,
            router_settings=stack_router_settings(self.options),
            upstream_host_header=False,
            router_replicas=max([1, *(REPLICAS.get(p, 1) for p in self.options.paths)]),
            control_plane_settings=control_plane_settings(self.options),
            work_dir=self.work / "stack",
        )
        self.stack = LocalStack(spec).start()
        self._start_ring_hash(self.stack)
        for path in self.options.paths:
            if path in ENVOY_CHANGES:
                self._start_path_envoy(self.stack, path)

    def _start_simulators(self) -> None:
        argv = [sys.executable, "-m", "extproc", "sim", *simulator_args(self.options)]
        for address in self.all_addresses:
            argv += ["--address", address]
        self.sim = ManagedProcess("sims", argv, self.work / "sims.log").start()
        for address in self.all_addresses:
            health = partial(http_ok, f"http://{address}/health")
            wait_until(health, 60, address, self.sim)

    def _start_ring_hash(self, stack: LocalStack) -> None:
        """Envoy without ext_proc, consistent hashing on the session header, same EDS."""
        envoy, url, admin_url = stack.start_envoy_beside(
            "envoy-ring-hash", self.work / "stack", ext_proc=False, ring_hash_header=SESSION_HEADER
        )
        self.adopt(envoy)
        wait_until(
            lambda: stack.envoy_hosts() == set(self.addresses),
            30,
            "the fleet in the baseline Envoy",
        )
        self.ring_hash_url = url
        self.ring_hash_admin_url = admin_url

    def _start_path_envoy(self, stack: LocalStack, path: str) -> None:
        """The stack's Envoy again, in front of the same routers and EDS, with ``path``'s
        changes to its bootstrap."""
        envoy, url, admin_url = stack.start_envoy_beside(
            f"envoy-{path}", self.work / "stack", **ENVOY_CHANGES[path]
        )
        self.adopt(envoy)
        wait_until(
            lambda: stack.envoy_hosts(admin_url=admin_url) == set(self.addresses),
            30,
            f"the fleet in the Envoy of {path}",
        )
        self.path_envoys[path] = (url, admin_url)

    def set_time_scale(self, value: float) -> None:
        """Every simulator's time_scale, changed at run time (sim-only endpoint)."""
        for address in self.all_addresses:
            response = httpx.post(f"http://{address}/sim/time_scale", json={"time_scale": value})
            response.raise_for_status()

    def stop(self) -> None:
        for process in reversed(self._extra):
            process.stop()
        if self.stack is not None:
            self.stack.stop()
        if self.sim is not None:
            self.sim.stop()
