"""What Envoy sends a router over ext_proc, for tests that drive it without Envoy.

The router only reads these messages (``extproc/adapter/messages.py`` builds its answers),
so the builders live with the tests.
"""

from __future__ import annotations

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest


def request_headers(headers: dict[str, str], end_of_stream: bool = False) -> ProcessingRequest:
    """Request headers as Envoy sends them: each value in ``raw_value``."""
    request = ProcessingRequest()
    request.request_headers.end_of_stream = end_of_stream
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
