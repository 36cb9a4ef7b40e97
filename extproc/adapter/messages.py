"""Stateless builders for ext_proc messages (xds-protos upb classes: ~5 us each)."""

from __future__ import annotations

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


def _routing_common(decision: Decision) -> ext_proc.CommonResponse:
    common = ext_proc.CommonResponse()
    option = common.header_mutation.set_headers.add()
    # raw_value, not value: Envoy sets an empty header when only .value is filled.
    option.header.key = TARGET_HEADER
    option.header.raw_value = decision.primary.encode()
    option.append_action = _OVERWRITE
    return common


def _routing_metadata(decision: Decision, ticket: str | None = None) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    namespace = metadata.get_or_create_struct(LB_METADATA_NAMESPACE)
    # An ordered list: override_host tries the next entry on a retry.
    namespace[LB_METADATA_KEY] = ",".join(decision.targets)
    if ticket is not None:
        # Envoy's access log hands it back when the request completes.
        namespace[TICKET_KEY] = ticket
    return metadata


def route_on_headers(decision: Decision, ticket: str | None = None) -> ProcessingResponse:
    """Headers response carrying the decision: requests with no body, and STREAMED
    bodies, whose headers response waits for the body."""
    response = ProcessingResponse(dynamic_metadata=_routing_metadata(decision, ticket))
    response.request_headers.response.CopyFrom(_routing_common(decision))
    return response


def route_on_body(decision: Decision, ticket: str | None = None) -> ProcessingResponse:
    """Body response carrying the decision: the header for original-dst, metadata for
    override-host. Emitting both lets one router serve either Envoy bootstrap."""
    response = ProcessingResponse(dynamic_metadata=_routing_metadata(decision, ticket))
    response.request_body.response.CopyFrom(_routing_common(decision))
    return response


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
    header = immediate.headers.set_headers.add()
    header.header.key = "content-type"
    header.header.raw_value = b"application/json"
    header.append_action = _OVERWRITE
    return response
