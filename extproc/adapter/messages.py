"""Stateless builders for ext_proc messages (xds-protos upb classes: ~5 us each)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from extproc.adapter.completions import TICKET_KEY
from extproc.picker.decide import Decision

__all__ = ["ProcessingRequest", "ProcessingResponse"]

# The header an ORIGINAL_DST cluster reads, and the metadata an override_host policy reads.
TARGET_HEADER = "x-target-host"
LB_METADATA_NAMESPACE = "envoy.lb"
LB_METADATA_KEY = "x-gateway-destination-endpoint"

# FULL_DUPLEX_STREAMED body replies are cut to this (Envoy takes at most 64 KiB a reply;
# the Inference Extension's reference picker uses the same figure).
ECHO_CHUNK_BYTES = 62_000

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(message: ext_proc.HttpHeaders) -> dict[str, str]:
    """Lower-case header names to values; the first of duplicate headers wins.

    Envoy sends values in ``raw_value``; latin-1 keeps every byte without failing.
    """
    result: dict[str, str] = {}
    for header in message.headers.headers:
        name = header.key.lower()
        if name not in result:
            result[name] = header.raw_value.decode("latin-1") if header.raw_value else header.value
    return result


@dataclass(frozen=True, slots=True)
class Destination:
    """How a decision is written on the request: one header, and the ``envoy.lb`` value
    that an override_host policy (or a gateway's ``header_to_metadata``) reads."""

    header: str
    header_value: str
    metadata_value: str
    # An endpoint picker's gateway may have chosen its route on the old headers.
    clear_route_cache: bool = False
    # Set on the request as well (the conformance hook's echo instruction).
    extra_headers: tuple[tuple[str, str], ...] = ()


def destination(decision: Decision) -> Destination:
    """The router's own: the primary in ``x-target-host`` (original-dst), the ordered list
    in metadata (override_host tries the next entry on a retry)."""
    return Destination(TARGET_HEADER, decision.primary, ",".join(decision.targets))


def epp_destination(
    decision: Decision, endpoint_list: bool, extra_headers: tuple[tuple[str, str], ...] = ()
) -> Destination:
    """An endpoint picker's: header and metadata carry the same value, the primary or, with
    ``endpoint_list``, the ordered list (protocol 1.0.0)."""
    value = ",".join(decision.targets) if endpoint_list else decision.primary
    return Destination(LB_METADATA_KEY, value, value, True, extra_headers)


def _set_header(mutation: ext_proc.HeaderMutation, name: str, value: str) -> None:
    option = mutation.set_headers.add()
    # raw_value, not value: Envoy sets an empty header when only .value is filled.
    option.header.key = name
    option.header.raw_value = value.encode()
    option.append_action = _OVERWRITE


def _routing_common(where: Destination) -> ext_proc.CommonResponse:
    common = ext_proc.CommonResponse(clear_route_cache=where.clear_route_cache)
    _set_header(common.header_mutation, where.header, where.header_value)
    for name, value in where.extra_headers:
        _set_header(common.header_mutation, name, value)
    return common


def _routing_metadata(where: Destination, ticket: str | None = None) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    namespace = metadata.get_or_create_struct(LB_METADATA_NAMESPACE)
    namespace[LB_METADATA_KEY] = where.metadata_value
    if ticket is not None:
        # Envoy's access log hands it back when the request completes.
        namespace[TICKET_KEY] = ticket
    return metadata


def route_on_headers(where: Destination, ticket: str | None = None) -> ProcessingResponse:
    """Headers response carrying the decision: requests with no body, and STREAMED and
    FULL_DUPLEX_STREAMED bodies, whose headers response waits for the body."""
    response = ProcessingResponse(dynamic_metadata=_routing_metadata(where, ticket))
    response.request_headers.response.CopyFrom(_routing_common(where))
    return response


def route_on_body(where: Destination, ticket: str | None = None) -> ProcessingResponse:
    """Body response carrying the decision: the header for original-dst, metadata for
    override-host. Emitting both lets one router serve either Envoy bootstrap."""
    response = ProcessingResponse(dynamic_metadata=_routing_metadata(where, ticket))
    response.request_body.response.CopyFrom(_routing_common(where))
    return response


def echo_body(kind: str, data: bytes, end_of_stream: bool) -> Iterator[ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: the body bytes handed back unchanged, in pieces of at most
    ``ECHO_CHUNK_BYTES`` (bytes not echoed never reach the other side). ``kind`` is
    ``request_body`` or ``response_body``."""
    start = 0
    while True:
        piece = data[start : start + ECHO_CHUNK_BYTES]
        start += ECHO_CHUNK_BYTES
        last = start >= len(data)
        response = ProcessingResponse()
        streamed = getattr(response, kind).response.body_mutation.streamed_response
        streamed.body = piece
        streamed.end_of_stream = end_of_stream and last
        yield response
        if last:
            return


def headers_with(kind: str, headers: tuple[tuple[str, str], ...]) -> ProcessingResponse:
    """The answer to a headers message (``request_headers`` or ``response_headers``) that
    sets ``headers``; with none, the plain go-ahead."""
    response = ProcessingResponse()
    common = getattr(response, kind).response
    common.SetInParent()
    for name, value in headers:
        _set_header(common.header_mutation, name, value)
    return response


def _immediate(code: int, reason: str, message: bytes, kind: bytes) -> ProcessingResponse:
    """Envoy answers the client at once, with an OpenAI-shaped error, and sends nothing
    upstream."""
    response = ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = code
    immediate.details = reason
    immediate.body = (
        b'{"error":{"message":"' + message + b'","type":"' + kind
        + b'","code":' + str(code).encode() + b"}}"
    )  # fmt: skip
    _set_header(immediate.headers, "content-type", "application/json")
    return response


def unavailable(reason: str) -> ProcessingResponse:
    """503: an endpoint picker's answer when no endpoint in the gateway's subset is
    eligible."""
    return _immediate(
        http_status_pb2.ServiceUnavailable, reason, b"no eligible endpoint", b"service_unavailable"
    )


def too_many_requests(reason: str) -> ProcessingResponse:
    """429: an endpoint picker's answer while it sheds load."""
    return _immediate(
        http_status_pb2.TooManyRequests, reason, b"the router is overloaded", b"rate_limit_exceeded"
    )


def extend_timeout(seconds: int) -> ProcessingResponse:
    """No answer, only a longer ``message_timeout`` for the message Envoy waits on: the
    held headers, while a slow client is still sending its body."""
    response = ProcessingResponse()
    response.override_message_timeout.seconds = seconds
    return response


def continue_for(kind: str) -> ProcessingResponse:
    """The do-nothing answer to a message of ``kind`` (a ProcessingRequest oneof name)."""
    response = ProcessingResponse()
    getattr(response, kind).SetInParent()
    return response


def refuse_too_large(limit: int) -> ProcessingResponse:
    """Envoy answers the client 413 at once, with an OpenAI-shaped error, and sends
    nothing upstream."""
    response = ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = http_status_pb2.PayloadTooLarge
    immediate.details = "prefix_router_body_too_large"
    immediate.body = (
        b'{"error":{"message":"request body exceeds '
        + str(limit).encode()
        + b' bytes","type":"invalid_request_error","code":413}}'
    )
    _set_header(immediate.headers, "content-type", "application/json")
    return response
