"""The gRPC edge of completions: Envoy's access log (AccessLogService) reports here each
request that is done, and the tickets in those entries release their in-flight slots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from envoy.service.accesslog.v3.als_pb2 import (
    StreamAccessLogsMessage,
    StreamAccessLogsResponse,
)

from extproc.adapter import metrics
from extproc.adapter.completions import TICKET_KEY
from extproc.adapter.messages import LB_METADATA_NAMESPACE
from extproc.adapter.routing import Router

SERVICE_NAME = "envoy.service.accesslog.v3.AccessLogService"


def tickets_of(message: StreamAccessLogsMessage) -> list[str]:
    """The router tickets in a batch of HTTP log entries ('' for an entry without one)."""
    tickets = []
    for entry in message.http_logs.log_entry:
        namespaces = entry.common_properties.metadata.filter_metadata
        ticket = ""
        if LB_METADATA_NAMESPACE in namespaces:
            value = namespaces[LB_METADATA_NAMESPACE].fields.get(TICKET_KEY)
            if value is not None:
                ticket = value.string_value
        tickets.append(ticket)
    return tickets


class AccessLogSink:
    def __init__(self, router: Router, stop: asyncio.Event) -> None:
        self._router = router
        self._stop = stop

    async def stream_logs(
        self,
        requests: AsyncIterator[StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[StreamAccessLogsMessage, StreamAccessLogsResponse],
    ) -> StreamAccessLogsResponse:
        completions = self._router.ledger.completions
        completions.streams += 1
        reader = asyncio.ensure_future(self._read(requests))
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            # A log stream never ends by itself: a draining router ends it, or it would
            # hold the drain for its whole grace period.
            await asyncio.wait((reader, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            completions.streams -= 1
            for task in (reader, stopping):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return StreamAccessLogsResponse()

    async def _read(self, requests: AsyncIterator[StreamAccessLogsMessage]) -> None:
        ledger = self._router.ledger
        async for message in requests:
            for ticket in tickets_of(message):
                completed = bool(ticket) and ledger.complete(ticket)
                metrics.COMPLETIONS.labels("completed" if completed else "foreign").inc()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    self.stream_logs,
                    request_deserializer=StreamAccessLogsMessage.FromString,
                    response_serializer=StreamAccessLogsResponse.SerializeToString,
                )
            },
        )
