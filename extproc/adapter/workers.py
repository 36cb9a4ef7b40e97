"""``router --workers N`` and ``epp --workers N``: N router processes under one supervisor.

grpc.aio serves from one thread, so one router process uses one core however many the
machine has. Envoy spreads its ext_proc streams over the endpoints of the router cluster,
so N processes on N ports serve N times the streams, with no shared state to lock: each
worker has its own prefix index, as router replicas do (see docs/architecture.md), and
hears of its siblings' decisions by message (below).

A gateway knows one address for its endpoint picker, so there (``workers_share_listen``)
every worker binds ``listen`` itself with SO_REUSEPORT and the kernel spreads the
gateway's connections over them. Either way each worker has its own metrics port (+ i),
and ``health_listen``, a pod's probe address, is one address all of them bind.

With ``workers_share_decisions`` (the default) the workers tell each other their
decisions (``decision_exchange.py``) over ipc sockets in a folder of the supervisor's,
made private at start and removed at the end: each worker binds its own and subscribes
to the others'.

The supervisor starts each worker in a spawned process (its own interpreter, event loop,
gRPC server and metrics port), restarts a worker that dies, and on SIGTERM or SIGINT
passes the signal on and waits for every worker to drain. A worker whose first start
ends before it is listening (a port in use, a bad address) stops them all: that is a
setup error, not a crash to retry.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from extproc.config import RouterConfig
from extproc.schema import MAX_SOCKET_PATH_BYTES, socket_path

log = structlog.get_logger()

# Restart delays: doubling from the first up to the last, back to the first once a worker
# has stayed up for STABLE_S.
RESTART_BACKOFF_S = (0.5, 30.0)
STABLE_S = 60.0
# How long past its drain_timeout_s a worker may take to stop after SIGTERM: the health
# checks' notice (up to 3 s), then closing down.
STOP_MARGIN_S = 10.0


def worker_address(address: str, index: int) -> str:
    """``address`` with its port moved up by ``index``: where worker ``index`` listens. A
    Unix socket's path gets ``.index`` appended instead (worker 0 keeps the path)."""
    if socket_path(address) is not None:
        return f"{address}.{index}" if index else address
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + index}"


def worker_overrides(
    config: RouterConfig,
    overrides: Mapping[str, Any],
    index: int,
    exchange: Sequence[str] = (),
) -> dict[str, Any]:
    """The overrides that make worker ``index`` of ``config``, one worker: its own metrics
    port, and its own listen port unless the workers share ``listen`` (health_listen is
    always shared). ``exchange``: every worker's decision-exchange endpoint, by index
    (empty: the workers share no decisions)."""
    shared = config.workers_share_listen
    own = {
        **overrides,
        "listen": config.listen if shared else worker_address(config.listen, index),
        "metrics_listen": worker_address(config.metrics_listen, index),
        "workers": 1,
    }
    if exchange:
        own["decision_exchange_bind"] = exchange[index]
        own["decision_exchange_peers"] = [e for i, e in enumerate(exchange) if i != index]
    return own


def exchange_endpoints(run_dir: Path, workers: int) -> list[str]:
    """Each worker's decision-exchange endpoint: an ipc socket in ``run_dir``."""
    return [f"ipc://{run_dir / f'decisions-{i}'}" for i in range(workers)]


def _exit_with_parent(parent: int) -> None:
    """SIGTERM this worker once its supervisor is gone (killed without a chance to stop
    it), so no orphan keeps a port and goes on taking streams unsupervised."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(
    config_path: Path | None,
    overrides: dict[str, Any],
    index: int,
    parent: int,
    listening: EventType,
) -> None:
    from extproc import logs
    from extproc.adapter.service import run
    from extproc.config import load_config

    config = load_config(config_path, overrides=overrides)
    logs.configure(config.log_level)
    structlog.contextvars.bind_contextvars(worker=index)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    run(config, config_path=config_path, overrides=overrides, on_listening=listening.set)


@dataclass
class _Worker:
    index: int
    process: SpawnProcess
    # Set by the worker once its ports are bound.
    listening: EventType
    started_at: float
    starts: int = 1
    restart_at: float | None = None


class Supervisor:
    def __init__(
        self,
        config: RouterConfig,
        config_path: Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.config = config
        self._config_path = config_path
        self._overrides = dict(overrides or {})
        self._context = multiprocessing.get_context("spawn")
        self._clock = clock
        self._stop = threading.Event()
        self._workers: list[_Worker] = []
        self._delays: dict[int, float] = {}
        # Each worker's decision-exchange endpoint (workers_share_decisions), by index.
        self._exchange: list[str] = []

    def _spawn(self, index: int, now: float) -> _Worker:
        listening = self._context.Event()
        overrides = worker_overrides(self.config, self._overrides, index, self._exchange)
        process = self._context.Process(
            target=_worker_main,
            args=(self._config_path, overrides, index, os.getpid(), listening),
            name=f"prefix-router-worker-{index}",
        )
        process.start()
        log.info(
            "router_worker_started",
            worker=index,
            pid=process.pid,
            listen=overrides["listen"],
            metrics=overrides["metrics_listen"],
        )
        return _Worker(index, process, listening, now)

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT; 0 after a clean stop, 1 after a setup error."""
        previous = {
            signum: signal.signal(signum, self._on_signal)
            for signum in (signal.SIGINT, signal.SIGTERM)
        }
        run_dir = self._share_decisions()
        try:
            now = self._clock()
            self._workers = [self._spawn(i, now) for i in range(self.config.workers)]
            code = self._watch()
        finally:
            self._stop_all()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        log.info("router_workers_stopped", workers=len(self._workers))
        return code

    def _share_decisions(self) -> Path | None:
        """With workers_share_decisions: a private folder (mode 0700) for the workers'
        decision-exchange sockets, each worker's endpoint noted for its overrides."""
        config = self.config
        if config.workers < 2 or not config.workers_share_decisions:
            return None
        run_dir = Path(tempfile.mkdtemp(prefix="prefix-router-"))
        endpoints = exchange_endpoints(run_dir, config.workers)
        if len(endpoints[-1].removeprefix("ipc://").encode()) > MAX_SOCKET_PATH_BYTES:
            log.warning("decisions_not_shared", reason=f"{run_dir} is too long a socket path")
            shutil.rmtree(run_dir, ignore_errors=True)
            return None
        self._exchange = endpoints
        return run_dir

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def _watch(self) -> int:
        low, high = RESTART_BACKOFF_S
        while not self._stop.wait(0.2):
            now = self._clock()
            for worker in self._workers:
                if worker.restart_at is not None:
                    if now >= worker.restart_at:
                        restarted = self._spawn(worker.index, now)
                        restarted.starts = worker.starts + 1
                        self._workers[worker.index] = restarted
                    continue
                if worker.process.is_alive():
                    continue
                lived = now - worker.started_at
                code = worker.process.exitcode
                if worker.starts == 1 and not worker.listening.is_set():
                    log.error("router_worker_failed_to_start", worker=worker.index, exitcode=code)
                    return 1
                previous = self._delays.get(worker.index)
                delay = low if lived >= STABLE_S or previous is None else min(high, previous * 2)
                self._delays[worker.index] = delay
                worker.restart_at = now + delay
                log.error(
                    "router_worker_exited",
                    worker=worker.index,
                    exitcode=code,
                    lived_s=round(lived, 1),
                    restart_in_s=delay,
                )
        return 0

    def _stop_all(self) -> None:
        alive = [w.process for w in self._workers if w.process.is_alive()]
        for process in alive:
            process.terminate()  # SIGTERM: the worker drains as a lone router does
        deadline = time.monotonic() + self.config.drain_timeout_s + STOP_MARGIN_S
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("router_worker_killed", pid=process.pid)
                process.kill()
                process.join()
