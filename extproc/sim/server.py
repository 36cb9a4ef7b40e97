"""HTTP front of the simulated vLLM: one independent instance per listen address."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import signal
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.exposition import choose_encoder

from extproc.sim.cache import PrefixCache
from extproc.sim.metrics import SimMetrics
from extproc.sim.prompt import PromptKind
from extproc.sim.request import CompletionRequest, parse_request
from extproc.sim.responses import (
    SSE_DONE,
    Envelope,
    error_body,
    filler_tokens,
    full_response,
    sse_event,
    token_chunk,
    usage,
    usage_chunk,
)

# Bodies of several MB must pass; aiohttp's default limit is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024
# How long in-flight requests may run on once an instance is told to stop.
_SHUTDOWN_GRACE_S = 1.0

SERVED_BY_HEADER = "x-served-by"
BODY_BYTES_HEADER = "x-request-body-bytes"
BODY_SHA256_HEADER = "x-request-body-sha256"

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SimOptions:
    """Behaviour shared by every simulated instance."""

    model: str = "sim-model"
    capacity_blocks: int = 4096
    block_size_tokens: int = 16
    chars_per_token: int = 4
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    default_max_tokens: int = 16
    max_tokens_cap: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        for name in (
            "capacity_blocks",
            "block_size_tokens",
            "chars_per_token",
            "default_max_tokens",
            "max_tokens_cap",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("ttft_ms", "itl_ms"):
            value = getattr(self, name)
            valid = isinstance(value, int | float) and not isinstance(value, bool)
            if not valid or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


async def _pause(delay_ms: float) -> None:
    # Skipping zero delays keeps the fast path free of scheduler round trips.
    if delay_ms > 0:
        await asyncio.sleep(delay_ms / 1000)


def _json_response(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(payload).encode(), content_type="application/json"
    )


def _bad_request(message: str) -> web.Response:
    return _json_response(error_body(message), status=400)


class _Instance:
    """State and handlers of one simulated vLLM instance."""

    def __init__(self, name: str, options: SimOptions) -> None:
        self.name = name
        self.options = options
        self.cache = PrefixCache(
            options.capacity_blocks, options.block_size_tokens, options.chars_per_token
        )
        self.metrics = SimMetrics(
            options.model, lambda: self.cache.blocks_used / self.cache.capacity_blocks
        )

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

        self.metrics.request_started()
        try:
            cached = self.cache.lookup_and_insert(parsed.prompt)
            self.metrics.prompt_processed(cached)
            envelope = Envelope.new(kind, self.options.model)
            usage_body = usage(cached.query_tokens, parsed.max_tokens, cached.hit_tokens)
            if parsed.stream:
                return await self._stream(request, envelope, parsed, usage_body)
            return await self._respond_whole(envelope, parsed, usage_body)
        finally:
            # Also runs when a client abort cancels the handler.
            self.metrics.request_ended()

    async def _respond_whole(
        self, envelope: Envelope, parsed: CompletionRequest, usage_body: dict[str, Any]
    ) -> web.Response:
        tokens = filler_tokens(parsed.max_tokens)
        await _pause(self.options.ttft_ms + self.options.itl_ms * (len(tokens) - 1))
        self.metrics.tokens_generated(len(tokens))
        self.metrics.request_succeeded()
        return _json_response(full_response(envelope, "".join(tokens), usage_body))

    async def _stream(
        self,
        request: web.Request,
        envelope: Envelope,
        parsed: CompletionRequest,
        usage_body: dict[str, Any],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        response.content_type = "text/event-stream"
        await response.prepare(request)
        tokens = filler_tokens(parsed.max_tokens)
        try:
            for index, token in enumerate(tokens):
                await _pause(self.options.ttft_ms if index == 0 else self.options.itl_ms)
                chunk = token_chunk(
                    envelope, token, first=index == 0, last=index == len(tokens) - 1
                )
                await response.write(sse_event(chunk))
                self.metrics.tokens_generated(1)
            if parsed.include_usage:
                await response.write(sse_event(usage_chunk(envelope, usage_body)))
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            # The client left mid-stream; nothing more to send.
            return response
        self.metrics.request_succeeded()
        return response

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


def build_app(name: str, options: SimOptions) -> web.Application:
    """The aiohttp app of one simulated instance; `name` goes into x-served-by."""
    instance = _Instance(name, options)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[instance.read_post_body])
    app.on_response_prepare.append(instance.stamp_headers)
    app.router.add_post("/v1/chat/completions", instance.chat)
    app.router.add_post("/v1/completions", instance.completion)
    app.router.add_get("/health", instance.health)
    app.router.add_get("/v1/models", instance.models)
    app.router.add_get("/metrics", instance.prometheus)
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
    try:
        for host, port in addresses:
            name = f"{host}:{port}"
            runner = web.AppRunner(
                build_app(name, options),
                # Cancel the handler when its client goes away, as vLLM aborts.
                handler_cancellation=True,
                # Hash the bytes as sent: never inflate a gzip body before the digest.
                auto_decompress=False,
                shutdown_timeout=_SHUTDOWN_GRACE_S,
                access_log=None,
            )
            runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            log.info("sim.listening", address=name, model=options.model)
        if ready is not None:
            ready.set()
        await asyncio.Future()  # until cancelled
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


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
