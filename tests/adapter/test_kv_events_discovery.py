"""The router's KV-event discovery (adapter/kv_events.py, ``discover``): what a host's
``GET /kv_event_sources`` and ``GET /v1/models`` answers become, and which answers are a
failed discovery (the host is asked again later)."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from extproc.adapter import kv_events
from extproc.adapter.kv_events import CODEPOINTS, Discovered, discover
from extproc.events.subscriber import EventSource
from extproc.http_client import host_client
from extproc.stack.processes import free_port

# A loopback address of its own keeps these tests clear of other suites' ports.
HOST = "127.0.0.91"
NOTHING = Discovered((), "", None, None)
SOURCES = {
    "0": {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv",
        "token_ids": CODEPOINTS,
    }
}
LISTING = {
    "data": [
        {"id": "sql-lora", "parent": "base-model", "root": "/loras/sql"},
        {"id": "base-model", "parent": None, "root": "/models/base"},
    ]
}


def reply(
    status: int = 200, body: bytes = b"", headers: Mapping[str, str] | None = None
) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(status=status, body=body, headers=headers)

    return handler


def reply_json(value: object) -> Handler:
    return reply(body=json.dumps(value).encode(), headers={"Content-Type": "application/json"})


MODELS = reply_json(LISTING)


@contextlib.asynccontextmanager
async def engine(sources: Handler, listing: Handler = MODELS) -> AsyncIterator[str]:
    """A host that answers /kv_event_sources with `sources` and /v1/models with `listing`."""
    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    app.router.add_get("/v1/models", listing)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port(HOST)
    try:
        await web.TCPSite(runner, HOST, port).start()
        yield f"{HOST}:{port}"
    finally:
        await runner.cleanup()


async def test_a_publishing_host_names_its_sources_and_its_base_model() -> None:
    async with engine(reply_json(SOURCES)) as host, host_client() as client:
        found = await discover(client, host)
    source = EventSource(host, f"tcp://{HOST}:5557", f"tcp://{HOST}:5558", "kv")
    assert found == Discovered((source,), CODEPOINTS, "base-model", "/models/base")


@pytest.mark.parametrize(
    "sources",
    [reply(404), reply_json({})],
    ids=["an engine without the endpoint", "events off"],
)
async def test_a_host_that_publishes_nothing_is_discovered_without_events(
    sources: Handler,
) -> None:
    async with engine(sources) as host, host_client() as client:
        assert await discover(client, host) == NOTHING


@pytest.mark.parametrize(
    ("sources", "listing", "error"),
    [
        (reply(500), MODELS, httpx.HTTPStatusError),
        # Not followed: the host answers for itself.
        (reply(307, headers={"Location": "/v1/models"}), MODELS, httpx.HTTPStatusError),
        (reply_json(SOURCES), reply(503), httpx.HTTPStatusError),
        (reply(body=b"\xff not json"), MODELS, ValueError),
        (reply_json(SOURCES), reply(body=b"<html>"), ValueError),
    ],
    ids=["sources 500", "sources redirect", "models 503", "sources not json", "models not json"],
)
async def test_a_failed_answer_fails_the_discovery(
    sources: Handler, listing: Handler, error: type[Exception]
) -> None:
    async with engine(sources, listing) as host, host_client() as client:
        with pytest.raises(error):
            await discover(client, host)


async def test_a_dead_host_fails_the_discovery() -> None:
    async with host_client() as client:
        with pytest.raises(httpx.ConnectError):
            await discover(client, f"{HOST}:{free_port(HOST)}")


async def test_a_hung_host_fails_within_the_discovery_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_events, "DISCOVERY_TIMEOUT_S", 0.1)
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        async with asyncio.timeout(10):
            await release.wait()
        return web.json_response({})

    try:
        async with engine(hang) as host, host_client() as client, asyncio.timeout(5):
            with pytest.raises(TimeoutError):
                await discover(client, host)
    finally:
        release.set()
