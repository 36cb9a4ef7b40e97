"""shed_backlog: a burst's streams past the backlog are decided on their headers at once,
through a real grpc.aio server and client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from extproc.adapter import messages, metrics
from extproc.adapter.routing import Router
from extproc.adapter.service import SERVICE_NAME, ExternalProcessor
from extproc.config import RouterConfig
from extproc.stack.processes import wait_until_async

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.31:8000", "127.0.0.32:8000")
HEADERS = {":method": "POST", "content-type": "application/json"}


@pytest.fixture
async def served() -> AsyncIterator[tuple[ExternalProcessor, grpc.aio.Channel]]:
    router = Router(RouterConfig(hosts=HOSTS, shed_backlog=2, shed_lag_s=None))
    processor = ExternalProcessor(router, reset_wait_s=0)
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


def open_call(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    return channel.stream_stream(
        f"/{SERVICE_NAME}/Process",
        request_serializer=messages.ProcessingRequest.SerializeToString,
        response_deserializer=messages.ProcessingResponse.FromString,
    )()


def decides(response: messages.ProcessingResponse, phase: str) -> bool:
    return getattr(response, phase).response.HasField("header_mutation")


async def test_streams_past_the_backlog_are_shed_until_it_drains(served):
    processor, channel = served
    shed_before = metrics.SHED._value.get()
    waiting = []
    for _ in range(2):  # headers answered, each waiting for its body: the backlog is full
        call = open_call(channel)
        await call.write(request_headers(HEADERS))
        assert not decides(await call.read(), "request_headers")
        waiting.append(call)
    assert processor.undecided == 2
    shed = open_call(channel)
    await shed.write(request_headers(HEADERS))
    answer = await shed.read()
    assert decides(answer, "request_headers")  # decided on its headers: no body is read
    assert metrics.SHED._value.get() == shed_before + 1
    assert await shed.code() == grpc.StatusCode.OK  # and its stream ended there
    await waiting[0].write(request_body(b'{"model":"m","prompt":"hello"}'))
    assert decides(await waiting[0].read(), "request_body")
    assert processor.undecided == 1
    admitted = open_call(channel)  # room again: decided on its body
    await admitted.write(request_headers(HEADERS))
    assert not decides(await admitted.read(), "request_headers")
    assert metrics.SHED._value.get() == shed_before + 1
    for call in (*waiting, admitted):
        call.cancel()  # gone undecided: they leave the backlog too
    await wait_until_async(lambda: processor.undecided == 0, 2, what="the backlog to drain")
