"""ext_proc request builders shared by the fuzz and replica tests."""

from __future__ import annotations

from extproc.adapter.messages import ProcessingRequest


def headers_message(headers: dict[str, str], end_of_stream: bool = False) -> ProcessingRequest:
    request = ProcessingRequest()
    request.request_headers.end_of_stream = end_of_stream
    for name, value in headers.items():
        header = request.request_headers.headers.headers.add()
        header.key = name
        header.raw_value = value.encode("latin-1")
    return request


def body_message(body: bytes, end_of_stream: bool = True) -> ProcessingRequest:
    request = ProcessingRequest()
    request.request_body.body = body
    request.request_body.end_of_stream = end_of_stream
    return request
