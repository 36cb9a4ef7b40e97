"""What Envoy sends a router over ext_proc, for tests that drive it without Envoy.

The router only reads these messages (``extproc/adapter/messages.py`` builds its answers),
so the builders live with the tests.
"""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest


def request_headers(
    headers: dict[str, str], end_of_stream: bool = False, streamed: bool = False
) -> ProcessingRequest:
    """Request headers as Envoy sends them: each value in ``raw_value``. ``streamed``: the
    first message's protocol_config of a STREAMED filter that sends the body without
    waiting for the headers response."""
    request = ProcessingRequest()
    request.request_headers.end_of_stream = end_of_stream
    if streamed:
        request.protocol_config.request_body_mode = ProcessingMode.STREAMED
        request.protocol_config.send_body_without_waiting_for_header_response = True
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
