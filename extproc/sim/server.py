"""HTTP front of the simulated vLLM: one independent instance per listen address."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.exposition import choose_encoder

from extproc.sim.cache import PrefixCache
from extproc.sim.engine import Engine
from extproc.sim.events import EventStream
from extproc.sim.generation import (
    EngineDriver,
    FixedGeneration,
    Generation,
    log_driver_exit,
)
from extproc.sim.metrics import SimMetrics
from extproc.sim.options import DEFAULT_CAPACITY_BLOCKS, SimOptions
from extproc.sim.prompt import PromptKind
from extproc.sim.request import CompletionRequest, parse_request
from extproc.sim.responses import (
    SSE_DONE,
    Envelope,
    error_body,
    filler_tokens,
    full_response,
    reply_text,
    sse_event,
    token_chunk,
    usage,
    usage_chunk,
)

# vLLM's server sets no body limit; aiohttp's default is 1 MiB. Far above the router's
# max_body_bytes (32 MiB), so that any 413 a client sees through the router is the router's.
MAX_BODY_BYTES = 256 * 1024 * 1024
# How long in-flight requests may run on once an instance is told to stop.
_SHUTDOWN_GRACE_S = 1.0

SERVED_BY_HEADER = "x-served-by"
BODY_BYTES_HEADER = "x-request-body-bytes"
BODY_SHA256_HEADER = "x-request-body-sha256"

log = structlog.get_logger(__name__)

__all__ = ["DEFAULT_CAPACITY_BLOCKS", "SimOptions", "build_app", "run", "serve"]


def _json_response(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(payload).encode(), content_type="application/json"
    )


def _bad_request(message: str) -> web.Response:
    return _json_response(error_body(message), status=400)


class _Instance:
    """State and handlers of one simulated vLLM instance."""

    def __init__(self, name: str, options: SimOptions, events: EventStream | None = None) -> None:
        self.name = name
        self.options = options
        self.events = events
        self.end_step = events.end_step if events is not None else _no_events
        assert options.capacity_blocks is not None  # resolved by SimOptions
        self.cache = PrefixCache(
            options.capacity_blocks,
            options.block_size_tokens,
            options.chars_per_token,
            listener=events.recorder if events is not None else None,
        )
        self.driver: EngineDriver | None = None
        if options.timing == "model":
            engine = Engine(options.engine_config(), self.cache)
            self.metrics = SimMetrics(
                options.model, engine.kv_usage, options.capacity_blocks, options.block_size_tokens
            )
            self.driver = EngineDriver(engine, self.metrics, self.end_step)
        else:
            # Without requests that hold blocks, every cached block counts as used.
            self.metrics = SimMetrics(
                options.model,
                lambda: self.cache.blocks_used / self.cache.capacity_blocks,
                options.capacity_blocks,
                options.block_size_tokens,
            )

    async def run_engine(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: the engine's step loop lives as long as the app."""
        if self.driver is None:
            yield
            return
        task = asyncio.create_task(self.driver.run(), name=f"sim-engine {self.name}")
        task.add_done_callback(log_driver_exit)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @web.middleware
    async def read_post_body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Read every POST body up front so that any response can report its digest."""
        if request.method == "POST":
            try:
                await request.read()
            except web.HTTPRequestEntityTooLarge:
                return _json_response(
                    error_body(f"request body exceeds {request.client_max_size} bytes"), status=413
                )
        return await handler(request)

    async def stamp_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare hook: runs for every response, streamed or not."""
        response.headers[SERVED_BY_HEADER] = self.name
        # 413 is the one POST whose body was not (fully) read; re-reading would
        # consume the rest of the stream and report a wrong digest.
        if request.method == "POST" and response.status != 413:
            raw = await request.read()  # cached by read_post_body
            response.headers[BODY_BYTES_HEADER] = str(len(raw))
            response.headers[BODY_SHA256_HEADER] = hashlib.sha256(raw).hexdigest()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completion(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completion")

    async def _complete(self, request: web.Request, kind: PromptKind) -> web.StreamResponse:
        try:
            parsed = parse_request(
                kind,
                await request.read(),
                default_max_tokens=self.options.default_max_tokens,
                max_tokens_cap=self.options.max_tokens_cap,
            )
        except ValueError as exc:
            return _bad_request(str(exc))

        arrived = asyncio.get_running_loop().time()
        try:
            generation = self._start(parsed)
        except ValueError as exc:  # the engine model: a request that can never fit
            return _bad_request(str(exc))
        try:
            envelope = Envelope.new(kind, self.options.model)
            if parsed.stream:
                return await self._stream(request, envelope, parsed, generation, arrived)
            return await self._respond_whole(envelope, parsed, generation, arrived)
        finally:
            # Also runs when a client abort cancels the handler.
            generation.close()

    def _start(self, parsed: CompletionRequest) -> Generation:
        output = reply_text(parsed.max_tokens, self.options.chars_per_token)
        if self.driver is not None:
            return self.driver.start(parsed.prompt, parsed.max_tokens, output, parsed.cache_salt)
        return FixedGeneration(
            self.cache,
            self.metrics,
            parsed.prompt,
            parsed.max_tokens,
            ttft_s=self.options.scaled_s(self.options.ttft_ms),
            itl_s=self.options.scaled_s(self.options.itl_ms),
            output=output,
            salt=parsed.cache_salt,
            end_step=self.end_step,
        )

    def _first_token_out(self, arrived: float) -> None:
        self.metrics.first_token(asyncio.get_running_loop().time() - arrived)

    def _usage(self, parsed: CompletionRequest, generation: Generation) -> dict[str, Any]:
        cached = generation.cached
        return usage(cached.query_tokens, parsed.max_tokens, cached.hit_tokens)

    async def _respond_whole(
        self,
        envelope: Envelope,
        parsed: CompletionRequest,
        generation: Generation,
        arrived: float,
    ) -> web.Response:
        await generation.next_token()
        self._first_token_out(arrived)
        await generation.rest()
        text = reply_text(parsed.max_tokens, self.options.chars_per_token)
        self.metrics.request_succeeded()
        return _json_response(full_response(envelope, text, self._usage(parsed, generation)))

    async def _stream(
        self,
        request: web.Request,
        envelope: Envelope,
        parsed: CompletionRequest,
        generation: Generation,
        arrived: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        response.content_type = "text/event-stream"
        await response.prepare(request)
        tokens = filler_tokens(parsed.max_tokens, self.options.chars_per_token)
        try:
            for index, token in enumerate(tokens):
                await generation.next_token()
                if index == 0:
                    self._first_token_out(arrived)
                chunk = token_chunk(
                    envelope, token, first=index == 0, last=index == len(tokens) - 1
                )
                await response.write(sse_event(chunk))
            if parsed.include_usage:
                usage_body = self._usage(parsed, generation)
                await response.write(sse_event(usage_chunk(envelope, usage_body)))
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            # The client left mid-stream; nothing more to send.
            return response
        self.metrics.request_succeeded()
        return response

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode endpoint: forget every cached block no running request holds.

        Its KV event goes out with the next engine step's, as in vLLM, whose engine core
        publishes events only at the end of a step."""
        dropped = self.cache.clear_unreferenced()
        log.info("sim.prefix_cache_reset", instance=self.name, blocks=dropped)
        return web.Response(status=200)

    async def set_time_scale(self, request: web.Request) -> web.Response:
        """Sim-only: change time_scale at run time (0 answers at once, for overhead probes).

        Takes effect for requests that arrive and steps that start afterwards; benchmarks
        change it while the instance is idle."""
        try:
            value = json.loads(await request.read())["time_scale"]
            options = replace(self.options, time_scale=value)
        except (ValueError, KeyError, TypeError) as error:
            return _bad_request(f'expected {{"time_scale": number >= 0}}: {error}')
        self.options = options
        if self.driver is not None:
            engine = self.driver.engine
            engine.config = replace(engine.config, time_scale=options.time_scale)
        log.info("sim.time_scale", instance=self.name, time_scale=options.time_scale)
        return _json_response({"time_scale": options.time_scale})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM's KV-event publisher config per data-parallel rank; {} without events."""
        if self.events is None:
            return _json_response({})
        return _json_response({"0": self.events.source()})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.options.model,
            "object": "model",
            "created": 0,
            "owned_by": "extproc-sim",
        }
        return _json_response({"object": "list", "data": [model]})

    async def prometheus(self, request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encode(self.metrics.registry))
        # Set raw: content_type= would reject the version/charset parameters.
        response.headers["Content-Type"] = content_type
        return response


def _no_events() -> None:
    pass


def build_app(name: str, options: SimOptions, events: EventStream | None = None) -> web.Application:
    """The aiohttp app of one simulated instance; `name` goes into x-served-by. `events`,
    if given, hears its cache (the caller closes it)."""
    instance = _Instance(name, options, events)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[instance.read_post_body])
    app.on_response_prepare.append(instance.stamp_headers)
    app.cleanup_ctx.append(instance.run_engine)
    app.router.add_post("/v1/chat/completions", instance.chat)
    app.router.add_post("/v1/completions", instance.completion)
    app.router.add_post("/reset_prefix_cache", instance.reset_prefix_cache)
    app.router.add_post("/sim/time_scale", instance.set_time_scale)
    app.router.add_get("/health", instance.health)
    app.router.add_get("/v1/models", instance.models)
    app.router.add_get("/metrics", instance.prometheus)
    app.router.add_get("/kv_event_sources", instance.kv_event_sources)
    return app


async def serve(
    addresses: list[tuple[str, int]],
    options: SimOptions,
    ready: asyncio.Event | None = None,
) -> None:
    """Serve one instance per (host, port) until cancelled; set `ready` once all are bound."""
    if not addresses:
        raise ValueError("addresses must name at least one (host, port)")
    runners: list[web.AppRunner] = []
    streams: list[EventStream] = []
    try:
        for host, port in addresses:
            name = f"{host}:{port}"
            events = None
            if options.kv_events:
                events = EventStream(
                    host,
                    options.kv_events_port,
                    options.kv_events_replay_port,
                    options.block_size_tokens * options.chars_per_token,
                )
                streams.append(events)
            runner = web.AppRunner(
                build_app(name, options, events),
                # Cancel the handler when its client goes away, as vLLM aborts.
                handler_cancellation=True,
                # Hash the bytes as sent: never inflate a gzip body before the digest.
                auto_decompress=False,
                shutdown_timeout=_SHUTDOWN_GRACE_S,
                access_log=None,
                keepalive_timeout=options.keepalive_s,
            )
            runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            log.info(
                "sim.listening",
                address=name,
                model=options.model,
                timing=options.timing,
                kv_events=events.endpoint if events is not None else None,
            )
        if ready is not None:
            ready.set()
        await asyncio.Future()  # until cancelled
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        # After the apps: their engines may record a last step while shutting down.
        for stream in streams:
            stream.close()


async def _serve_until_signalled(addresses: list[tuple[str, int]], options: SimOptions) -> None:
    loop = asyncio.get_running_loop()
    server = asyncio.create_task(serve(addresses, options))
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({server, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        stopper.cancel()
        server.cancel()
        # A signal ends the server by cancellation; that is the clean exit.
        with contextlib.suppress(asyncio.CancelledError):
            await server
    log.info("sim.stopped")


def run(addresses: list[tuple[str, int]], options: SimOptions) -> None:
    """Blocking CLI entry: serve until SIGINT or SIGTERM, then return normally."""
    asyncio.run(_serve_until_signalled(addresses, options))
