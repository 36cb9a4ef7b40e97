"""Simulators, ``prefix-router epp`` and the real Envoy configured as a gateway configures
it (``gateways.py``): what tests/integration/test_epp_gateways.py and
``prefix-router bench concurrency --gateway`` run."""

from __future__ import annotations

import functools
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack.gateways import Gateway, GatewayParams, render_gateway
from extproc.stack.local import READY_TIMEOUT_S, envoy_binary
from extproc.stack.processes import (
    ManagedProcess,
    free_port,
    free_ports,
    http_ok,
    tcp_open,
    wait_until,
)
from extproc.stack.prometheus import scrape, scrape_metric

SIM_ARGS = ("--ttft-ms", "0", "--itl-ms", "5")
# The picker's settings: simulators answer at once, so no modelled prefill queue.
PICKER_SETTINGS: dict[str, Any] = {"prefill_tokens_per_s": None, "concurrency_threshold": 64}


class EppGateway:
    """Three simulators on 127.0.0.11-13, a fourth endpoint on .13 (a data-parallel rank:
    two ports of one pod), the picker, and an Envoy configured as ``gateway`` does."""

    def __init__(
        self,
        gateway: Gateway,
        picker_hosts: bool = True,
        sim_args: tuple[str, ...] = SIM_ARGS,
        conformance_hooks: bool = True,
        upstream_host_header: bool = True,
    ) -> None:
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"epp-{gateway}-"))
        self.sim_args = sim_args
        self.conformance_hooks = conformance_hooks
        port, rank_port = free_ports(2, "127.0.0.13")
        self.pool = (
            ("127.0.0.11", port),
            ("127.0.0.12", port),
            ("127.0.0.13", port),
            ("127.0.0.13", rank_port),
        )
        grpc_port, health_port, metrics_port = free_ports(3)
        self.picker_ports = (grpc_port, health_port, metrics_port)
        self.params = GatewayParams(
            gateway=gateway,
            listen=("127.0.0.1", free_port()),
            admin=("127.0.0.1", free_port()),
            picker=("127.0.0.1", grpc_port),
            pool=self.pool,
            upstream_host_header=upstream_host_header,
        )
        # Istio and the reference Envoy send no subset hint: the picker knows the pool.
        self.picker_hosts = picker_hosts
        self.sims: list[ManagedProcess] = []
        # Named as in LocalStack, which the benchmarks also drive.
        self.router: ManagedProcess | None = None
        self.envoys: list[ManagedProcess] = []

    @property
    def endpoints(self) -> set[str]:
        return {f"{h}:{p}" for h, p in self.pool}

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.params.listen)

    @property
    def admin_url(self) -> str:
        return "http://{}:{}".format(*self.params.admin)

    @property
    def router_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.picker_ports[2]}/metrics"

    def router_metric(self, name: str) -> float | None:
        return scrape_metric(self.router_metrics_url, name)

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the picker's metrics (0 when absent)."""
        for (sample, sample_labels), value in scrape(self.router_metrics_url).items():
            if sample == name and all(dict(sample_labels).get(k) == v for k, v in labels.items()):
                return value
        return 0.0

    def start(self) -> EppGateway:
        for host, port in self.pool:
            name = f"sim-{host}-{port}"
            argv = [sys.executable, "-m", "extproc", "sim", "--address", f"{host}:{port}"]
            self.sims.append(
                ManagedProcess(name, [*argv, *self.sim_args], self.work_dir / f"{name}.log").start()
            )
        for sim, (host, port) in zip(self.sims, self.pool, strict=True):
            ready = functools.partial(http_ok, f"http://{host}:{port}/health")
            wait_until(ready, READY_TIMEOUT_S, f"simulator {host}:{port}", sim)
        self.start_picker()
        self.envoys.append(self.start_envoy(self.params))
        return self

    def start_picker(self) -> None:
        grpc_port, health_port, metrics_port = self.picker_ports
        config = self.work_dir / "picker.yaml"
        config.write_text(yaml.safe_dump(PICKER_SETTINGS))
        argv = [
            sys.executable,
            "-m",
            "extproc",
            "epp",
            "--config",
            str(config),
            "--bind-address",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            # The reference chart's flags, which must be accepted as they come.
            "--pool-name",
            "vllm-pool",
            "--pool-namespace",
            "default",
            "--zap-encoder",
            "json",
            "--v",
            "1",
            "--tracing=false",
        ]
        if self.conformance_hooks:
            argv.append("--conformance-hooks")
        if self.picker_hosts:
            for host, port in self.pool:
                argv += ["--host", f"{host}:{port}"]
        self.router = ManagedProcess("picker", argv, self.work_dir / "picker.log").start()
        wait_until(
            lambda: self.health("readiness") == health_pb2.HealthCheckResponse.SERVING,
            READY_TIMEOUT_S,
            "picker",
            self.router,
        )

    def stop_picker(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def health(self, service: str) -> int | None:
        """The picker's health port's answer for ``service``; None if it does not answer."""
        address = f"127.0.0.1:{self.picker_ports[1]}"
        try:
            with grpc.insecure_channel(address) as channel:
                stub: Any = health_pb2_grpc.HealthStub(channel)  # its stubs lack Check
                request = health_pb2.HealthCheckRequest(service=service)
                return int(stub.Check(request, timeout=1).status)
        except grpc.RpcError:
            return None

    def start_envoy(self, params: GatewayParams) -> ManagedProcess:
        name = f"envoy-{len(self.envoys)}"
        path = self.work_dir / f"{name}.yaml"
        path.write_text(render_gateway(params))
        argv = [envoy_binary(), "-c", str(path), "--log-level", "warning"]
        envoy = ManagedProcess(name, [*argv, "--disable-hot-restart"], self.work_dir / name)
        envoy.start()
        admin = "http://{}:{}/ready".format(*params.admin)
        wait_until(
            lambda: http_ok(admin) and tcp_open(*params.listen), READY_TIMEOUT_S, name, envoy
        )
        return envoy

    def with_hint(self, hint: tuple[str, ...]) -> tuple[str, ManagedProcess]:
        """Another Envoy like this one whose subset hint is ``hint``: its URL."""
        params = replace(
            self.params,
            listen=("127.0.0.1", free_port()),
            admin=("127.0.0.1", free_port()),
            subset_hint=hint,
        )
        envoy = self.start_envoy(params)
        self.envoys.append(envoy)
        return "http://{}:{}".format(*params.listen), envoy

    def stop(self) -> None:
        for envoy in reversed(self.envoys):
            envoy.stop()
        self.stop_picker()
        for sim in self.sims:
            sim.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> EppGateway:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
