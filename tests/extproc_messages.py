"""What Envoy sends a router over ext_proc, for tests that drive it without Envoy.

The router only reads these messages (``extproc/adapter/messages.py`` builds its answers),
so the builders live with the tests.
"""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest


def request_headers(
    headers: dict[str, str],
    end_of_stream: bool = False,
    streamed: bool = False,
    duplex: bool = False,
    hint: list[str] | str | None = None,
) -> ProcessingRequest:
    """Request headers as Envoy sends them: each value in ``raw_value``. ``streamed``: the
    first message's protocol_config of a STREAMED filter that sends the body without
    waiting for the headers response; ``duplex``: of a FULL_DUPLEX_STREAMED filter (both
    directions), as the Inference Extension's gateways configure it. ``hint``: an endpoint
    picker's subset hint, as a list or a comma string."""
    request = ProcessingRequest()
    request.request_headers.end_of_stream = end_of_stream
    if streamed:
        request.protocol_config.request_body_mode = ProcessingMode.STREAMED
        request.protocol_config.send_body_without_waiting_for_header_response = True
    if duplex:
        request.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
        request.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    if hint is not None:
        subset = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        subset["x-gateway-destination-endpoint-subset"] = hint
    for name, value in headers.items():
        header = request.request_headers.headers.headers.add()
        header.key = name
        header.raw_value = value.encode("latin-1")
    return request


def request_body(body: bytes, end_of_stream: bool = True) -> ProcessingRequest:
    request = ProcessingRequest()
    request.request_body.body = body
    request.request_body.end_of_stream = end_of_stream
    return request


def response_headers(headers: dict[str, str], served: str | None = None) -> ProcessingRequest:
    """Response headers; ``served``: the endpoint a gateway reports in envoy.lb metadata."""
    request = ProcessingRequest()
    request.response_headers.SetInParent()
    for name, value in headers.items():
        header = request.response_headers.headers.headers.add()
        header.key = name
        header.raw_value = value.encode("latin-1")
    if served is not None:
        lb = request.metadata_context.filter_metadata["envoy.lb"]
        lb["x-gateway-destination-endpoint-served"] = served
    return request


def response_body(body: bytes, end_of_stream: bool = True) -> ProcessingRequest:
    request = ProcessingRequest()
    request.response_body.body = body
    request.response_body.end_of_stream = end_of_stream
    return request


def request_trailers() -> ProcessingRequest:
    request = ProcessingRequest()
    request.request_trailers.SetInParent()
    return request
