"""The gRPC edge: the ExternalProcessor service, the health service and their lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from extproc import keepalive, tls
from extproc import metrics as shared_metrics
from extproc.adapter import messages, metrics
from extproc.adapter.access_log import AccessLogSink
from extproc.adapter.decision_exchange import DecisionExchange
from extproc.adapter.fleet_client import FleetClient, FleetTls
from extproc.adapter.kv_events import KvEventsFeed
from extproc.adapter.lag import LoopLag
from extproc.adapter.phases import RequestStream
from extproc.adapter.routing import Router
from extproc.config import EventLoop, PrefixMatch, RouterConfig, StreamEnd, load_config
from extproc.errors import ConfigError, StreamAborted
from extproc.filewatch import FileWatcher
from extproc.picker.hosts import HostSet
from extproc.schema import restart_fields, socket_path

log = structlog.get_logger("server")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# What the gRPC health service reports on: "" (the server), the ext_proc service, and the
# names the Inference Extension's charts probe. All follow readiness (a host set to place
# over), except liveness, which is SERVING while the process serves at all.
READY_SERVICES = ("", SERVICE_NAME, "readiness", "inference-extension")
LIVENESS_SERVICE = "liveness"
# How long SIGTERM keeps accepting new streams while waiting for a health check to report
# NOT_SERVING (Envoy checks every second), so no stream is refused before Envoy moves on.
DRAIN_NOTICE_SECONDS = 3.0
# How long it keeps accepting after that check: Envoy's main thread reads the answer, then
# tells each worker thread, and a worker may open one more stream here meanwhile (once in
# a CI run, refused and failed open: a 503 behind original_dst). A few of those hops on a
# busy machine fit well inside it.
DRAIN_SETTLE_SECONDS = 0.5
MAX_MESSAGE_BYTES = 96 * 1024 * 1024


# How long a handler whose client half-closed waits for the reset that Envoy sends right
# after (closeStream() then resetStream()), so that the reset ends it by cancellation. A
# handler that returned at once would have gRPC send its status on a call the reset then
# cancels, and grpc.aio never frees a failed batch's buffers (grpc/grpc#43360). A client
# that half-closes and reads the status gets it this much later; its slot is already free.
RESET_WAIT_S = 1.0

# What ``context.read()`` answers once the client has half-closed.
_EOF: Any = grpc.aio.EOF


class ExternalProcessor:
    def __init__(
        self, router: Router, lag: LoopLag | None = None, reset_wait_s: float = RESET_WAIT_S
    ) -> None:
        self.router = router
        # How far behind the event loop runs; None: never shed.
        self.lag = lag
        self.reset_wait_s = reset_wait_s
        # Streams open and not yet decided: the backlog a burst builds before the loop lags.
        self.undecided = 0

    def shedding(self) -> bool:
        config = self.router.config
        if config.shed_backlog is not None and self.undecided >= config.shed_backlog:
            return True
        threshold = config.shed_lag_s
        return self.lag is not None and threshold is not None and self.lag.seconds >= threshold

    async def process(
        self,
        requests: AsyncIterator[messages.ProcessingRequest],
        context: grpc.aio.ServicerContext[messages.ProcessingRequest, messages.ProcessingResponse],
    ) -> AsyncIterator[messages.ProcessingResponse]:
        """One ext_proc stream. Messages are read through ``context.read()`` rather than
        ``requests`` (gRPC's iterator over the same reads) so that each read is shielded: a
        reset that cancels the handler mid-read must not cancel the read's gRPC batch,
        whose buffers grpc.aio would then never free (grpc/grpc#43360)."""
        end_at_decision = self.router.config.stream_end is StreamEnd.DECISION
        stream = RequestStream(self.router, end_at_decision, shed=self.shedding())
        metrics.STREAMS.inc()
        self.undecided += 1
        undecided = True
        # A read left pending at a FULL_DUPLEX_STREAMED deadline, taken up next turn.
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                deadline = stream.decide_by
                if deadline is None and pending is None:
                    request = await asyncio.shield(context.read())
                else:
                    pending = pending or asyncio.ensure_future(context.read())
                    if deadline is not None:
                        timeout = max(0.0, deadline - time.monotonic())
                        done, _ = await asyncio.wait((pending,), timeout=timeout)
                        if not done:
                            for response in stream.on_deadline():
                                yield response
                            continue
                    request = await asyncio.shield(pending)
                    pending = None
                if request is _EOF:
                    stream.close()  # the request is over: free its slot before the wait
                    if undecided:
                        self.undecided -= 1
                        undecided = False
                    await asyncio.sleep(self.reset_wait_s)
                    break
                try:
                    responses = stream.on_message(request)
                except StreamAborted as aborted:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, aborted.reason)
                except Exception:  # a bug must cost one request, not the router
                    metrics.PROTOCOL_ERRORS.labels("internal_error").inc()
                    log.exception("internal_error")
                    # Like any failure: Envoy's failure mode decides (see StreamAborted).
                    await context.abort(grpc.StatusCode.INTERNAL, "prefix_router_internal_error")
                if undecided and stream.settled:
                    self.undecided -= 1
                    undecided = False
                for response in responses:
                    yield response
                if stream.ended:
                    # An OK close: Envoy goes on without the router and forwards any body
                    # it still holds.
                    break
        finally:
            # Runs when the HTTP request completes, the client aborts or the router ends
            # the stream, so the in-flight slot is released exactly once.
            stream.close()
            metrics.STREAMS.dec()
            if undecided:
                self.undecided -= 1

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.process,
                    request_deserializer=messages.ProcessingRequest.FromString,
                    response_serializer=messages.ProcessingResponse.SerializeToString,
                )
            },
        )


class HealthService(health.aio.HealthServicer):
    """The gRPC health service, noting when it was last asked.

    A draining router keeps accepting streams until a health check has been answered
    NOT_SERVING: gRPC refuses new streams once the server stops, and Envoy would send
    them here until its next check.
    """

    def __init__(self) -> None:
        super().__init__()
        self.last_check: float | None = None
        self._checked = asyncio.Event()

    async def Check(
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.aio.ServicerContext[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        ],
    ) -> health_pb2.HealthCheckResponse:
        response = await super().Check(request, context)
        self.last_check = time.monotonic()
        self._checked.set()
        return response

    async def drain_notice(self, timeout_s: float = DRAIN_NOTICE_SECONDS) -> None:
        """After ``enter_graceful_shutdown``: wait for the next check (which reports
        NOT_SERVING), at most ``timeout_s``, then DRAIN_SETTLE_SECONDS for Envoy's worker
        threads to learn it. No wait if nothing has checked recently."""
        if self.last_check is None or time.monotonic() - self.last_check > timeout_s:
            return
        self._checked.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._checked.wait(), timeout=timeout_s)
            await asyncio.sleep(DRAIN_SETTLE_SECONDS)


class ConfigReloader:
    """Re-reads the router's config file when it changes and swaps the config in.

    Flags and environment overrides given at start stay in force. An invalid edit is
    rejected with a log line and the old config stays. Addresses need a restart.
    """

    # Marked ``restart=True`` where RouterConfig declares them.
    RESTART_FIELDS = restart_fields(RouterConfig)

    def __init__(self, router: Router, path: Path, overrides: Mapping[str, Any]) -> None:
        self._router = router
        self._watch = FileWatcher(path)
        self._overrides = dict(overrides)

    def check(self) -> bool:
        """Apply the file's config if it changed; False if unchanged or refused. Whatever
        goes wrong, the old config stays and the watch goes on."""
        if not self._watch.changed():
            return False
        try:
            return self._reload()
        except ConfigError as error:
            shared_metrics.CONFIG_RELOADS.labels("rejected").inc()
            log.error("config_reload_rejected", path=str(self._watch.path), error=str(error))
        except Exception:  # a bug, or input nothing anticipated: never the reload task
            shared_metrics.CONFIG_RELOADS.labels("failed").inc()
            log.exception("config_reload_failed", path=str(self._watch.path))
        return False

    def _reload(self) -> bool:
        old = self._router.config
        new = load_config(self._watch.path, overrides=self._overrides)
        restart_only = list(self.RESTART_FIELDS)
        if new.control_plane != old.control_plane:
            # Switching between static hosts and a control plane needs a restart too.
            restart_only.append("hosts")
        kept = {f: getattr(old, f) for f in restart_only if getattr(new, f) != getattr(old, f)}
        if kept:
            log.warning("config_reload_needs_restart", fields=sorted(kept))
            new = new.replace(**kept)
        hosts = (
            HostSet.of(new.hosts) if new.hosts != old.hosts and new.control_plane is None else None
        )
        self._router.config = new
        if hosts is not None:
            self._router.set_hosts(hosts)
        shared_metrics.CONFIG_RELOADS.labels("applied").inc()
        log.info(
            "config_reloaded",
            strategy=new.routing_strategy.value,
            concurrency_threshold=new.concurrency_threshold,
            prefix_length=new.prefix_length,
        )
        return True

    async def run(self, stop: asyncio.Event, interval_s: float = 0.5) -> None:
        while not stop.is_set():
            self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)


def run(
    config: RouterConfig,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """``serve`` on the event loop the config names, until it stops."""
    with asyncio.Runner(loop_factory=loop_factory(config.event_loop)) as runner:
        runner.run(
            serve(config, config_path=config_path, overrides=overrides, on_listening=on_listening)
        )


def loop_factory(kind: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the event loop ``kind`` for ``asyncio.Runner``."""
    if kind is EventLoop.UVLOOP:
        import uvloop

        return uvloop.new_event_loop
    return None  # asyncio's default


def check_socket_path_free(path: str) -> None:
    """Raise OSError if ``path`` is taken: by a file that is not a socket, or by a socket a
    process still listens on. gRPC would unlink either and bind over it, so a second router
    would silently take a running one's streams; a socket nobody listens on (a router that
    was killed) is left for gRPC to replace."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"cannot listen on unix:{path}: it exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return
    finally:
        probe.close()
    raise OSError(f"cannot listen on unix:{path}: another process is listening on it")


def fleet_tls(config: RouterConfig) -> FleetTls | None:
    """How the xDS client reaches the control plane: None for plaintext."""
    if config.control_plane_ca_file is None:
        return None
    credentials = tls.channel_credentials(
        config.control_plane_ca_file, config.control_plane_cert_file, config.control_plane_key_file
    )
    return FleetTls(credentials, config.control_plane_server_name)


def reuse_port(shared: bool) -> tuple[str, int]:
    """The gRPC option that binds a port shared with other processes (SO_REUSEPORT: the
    kernel spreads new connections over them) or this process's alone. gRPC sets
    SO_REUSEPORT unless told not to, which would let a second router on the same port
    take half of the first one's connections without an error."""
    return ("grpc.so_reuseport", int(shared))


def server_options(shared: bool = False) -> list[tuple[str, int]]:
    """The ext_proc server's gRPC options (the overhead bench's noop processor uses them
    too); ``shared``: its port is shared with the other workers (``workers_share_listen``)."""
    return [
        # Envoy sends its buffer limit (40 MiB by default) of body in one message, and more;
        # gRPC's default 4 MiB cap would fail those streams.
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        reuse_port(shared),
        *keepalive.server_options(),
    ]


async def serve(
    config: RouterConfig,
    stop: asyncio.Event | None = None,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Run the router until ``stop`` is set (or SIGINT/SIGTERM), then drain and exit.
    ``on_listening`` is called once its ports are bound and the gRPC server started."""
    stop = stop or asyncio.Event()
    # Before anything that takes time: a SIGTERM while it starts (a supervisor stopping its
    # workers, a pod deleted at once) still ends in a drain and a clean exit.
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        # Its observers (the traffic log, shadow mode) come from the config; close() stops them.
        router = Router(config)
        server = grpc.aio.server(options=server_options(config.workers_share_listen))
        lag = LoopLag()
        metrics.LOOP_LAG.set_function(lambda: lag.seconds)
        processor = ExternalProcessor(router, lag)
        metrics.UNDECIDED.set_function(lambda: processor.undecided)
        server.add_generic_rpc_handlers(
            (processor.handler(), AccessLogSink(router, stop).handler())
        )
        health_servicer = HealthService()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        servers = [server]
        if config.health_listen is not None:
            # Health alone, in plaintext: Kubernetes' gRPC probes speak no TLS. Every worker
            # binds it (a pod has one probe address), whichever worker answers.
            health_server = grpc.aio.server(options=[reuse_port(True), *keepalive.server_options()])
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
            tls.listen(health_server, config.health_listen, None)
            servers.append(health_server)
        path = socket_path(config.listen)
        if path is not None:
            check_socket_path_free(path)
        credentials = tls.server_credentials(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
        )
        tls.listen(server, config.listen, credentials)
        metrics_host, _, metrics_port = config.metrics_listen.rpartition(":")
        metrics_server, metrics_thread = start_http_server(int(metrics_port), addr=metrics_host)
        background: list[asyncio.Task[None]] = [asyncio.create_task(lag.run(stop))]
        if config.control_plane is not None:
            client = FleetClient(router, config.control_plane, config.cluster, fleet_tls(config))
            background.append(asyncio.create_task(client.run(stop)))
        if config.kv_events and config.prefix_match is PrefixMatch.LONGEST:
            router.kv_events = KvEventsFeed(router.index, config)
            router.kv_events.set_hosts(router.hosts.addresses)
            metrics.KV_EVENTS.track(router.kv_events)
            background.append(asyncio.create_task(router.kv_events.run(stop)))
        exchange: DecisionExchange | None = None
        if config.decision_exchange_bind is not None or config.decision_exchange_peers:
            exchange = DecisionExchange(
                router, config.decision_exchange_bind, config.decision_exchange_peers
            )
            exchange.start()
            background.append(asyncio.create_task(exchange.run()))
        if config_path is not None:
            reloader = ConfigReloader(router, config_path, overrides or {})
            background.append(asyncio.create_task(reloader.run(stop)))
        for each in servers:
            await each.start()
        if on_listening is not None:
            on_listening()

        async def report_ready() -> None:
            # NOT_SERVING until there is a host set: Envoy's health checks keep streams away
            # from a router that could not place them.
            await router.ready.wait()
            for service in READY_SERVICES:
                await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            log.info("router_serving", hosts=len(router.hosts))

        background.append(asyncio.create_task(report_ready()))
        for service in READY_SERVICES:
            await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "router_started",
            listen=config.listen,
            metrics=config.metrics_listen,
            strategy=config.routing_strategy.value,
            tls=tls.server_mode(config.tls_cert_file, config.tls_client_ca_file),
            health_listen=config.health_listen,
            listen_shared=config.workers_share_listen,
            epp=config.epp,
            control_plane=config.control_plane,
            control_plane_tls=config.control_plane_ca_file is not None,
            hosts=len(router.hosts),
            event_loop=type(loop).__module__.split(".")[0],
        )

        try:
            await stop.wait()
        finally:
            # Tell Envoy's health checks first, keep serving until one has seen it, then
            # refuse new streams and let open ones finish.
            await health_servicer.enter_graceful_shutdown()
            log.info("router_draining", in_flight=router.ledger.in_flight.total())
            await health_servicer.drain_notice()
            await server.stop(router.config.drain_timeout_s)
            for each in servers[1:]:
                await each.stop(0)
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if exchange is not None:
                exchange.close()
            metrics_server.shutdown()
            metrics_thread.join(timeout=5)
            metrics_server.server_close()
            router.close()
            log.info("router_stopped")
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
