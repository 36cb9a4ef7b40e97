"""How an ext_proc stream ends, through a real grpc.aio server and client.

Envoy ends a finished request's stream with a half-close and then, at once, a reset. The
router frees the request's in-flight slot at the half-close and waits for the reset, so the
reset ends the handler (no status is sent on a cancelled call: grpc/grpc#43360). A client
that half-closes and reads the status instead still gets it, once ``reset_wait_s`` is over.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest

from extproc.adapter import messages, metrics
from extproc.adapter.routing import Router
from extproc.adapter.service import SERVICE_NAME, ExternalProcessor
from extproc.config import RouterConfig
from extproc.picker.decide import Strategy
from extproc.stack.processes import wait_until_async

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.31:8000", "127.0.0.32:8000")
WAIT_S = 5.0  # far longer than any check below waits: what ends early was not the wait


@pytest.fixture
async def served() -> AsyncIterator[tuple[ExternalProcessor, grpc.aio.Channel]]:
    router = Router(RouterConfig(hosts=HOSTS, routing_strategy=Strategy.RANDOM))
    processor = ExternalProcessor(router, reset_wait_s=WAIT_S)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((processor.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield processor, channel
    finally:
        await channel.close()
        await server.stop(0)


async def decided_call(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    """A stream whose request the router has decided and counts in flight (a
    BUFFERED_PARTIAL stream stays open through the response)."""
    call = channel.stream_stream(
        f"/{SERVICE_NAME}/Process",
        request_serializer=messages.ProcessingRequest.SerializeToString,
        response_deserializer=messages.ProcessingResponse.FromString,
    )()
    await call.write(request_headers({":method": "POST", "content-type": "application/json"}))
    await call.read()
    await call.write(request_body(b'{"model":"m","prompt":"hello"}'))
    decision = await call.read()
    assert decision.request_body.response.HasField("header_mutation")
    return call


async def until(check, timeout_s: float = 2.0) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``check()`` holds; fails after ``timeout_s``."""
    started = time.monotonic()
    await wait_until_async(check, timeout_s, interval_s=0.01)
    return time.monotonic() - started


async def test_half_close_then_reset_ends_the_stream_at_the_reset(served):
    processor, channel = served
    open_streams = metrics.STREAMS._value.get()
    call = await decided_call(channel)
    assert processor.router.ledger.in_flight.total() == 1
    await call.done_writing()  # the request is over: its slot is freed at once
    await until(lambda: processor.router.ledger.in_flight.total() == 0)
    assert metrics.STREAMS._value.get() == open_streams + 1  # waiting for the reset
    call.cancel()  # Envoy's resetStream(): the handler ends now, not after WAIT_S
    assert await until(lambda: metrics.STREAMS._value.get() == open_streams) < 1.0


async def test_a_client_that_reads_the_status_gets_ok_after_the_wait(served):
    processor, channel = served
    processor.reset_wait_s = 0.3
    call = await decided_call(channel)
    started = time.monotonic()
    await call.done_writing()
    await until(lambda: processor.router.ledger.in_flight.total() == 0, timeout_s=0.25)
    assert await call.code() == grpc.StatusCode.OK
    assert 0.3 <= time.monotonic() - started < 2.0


async def test_a_reset_without_a_half_close_frees_the_slot(served):
    processor, channel = served
    open_streams = metrics.STREAMS._value.get()
    call = await decided_call(channel)
    call.cancel()  # the client went away while the router was reading (shielded read)
    await until(lambda: processor.router.ledger.in_flight.total() == 0)
    await until(lambda: metrics.STREAMS._value.get() == open_streams)
