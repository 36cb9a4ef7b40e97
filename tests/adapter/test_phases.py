"""The ext_proc phase machine, driven with real protobuf messages and no sockets."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapter.messages import (
    LB_METADATA_KEY,
    LB_METADATA_NAMESPACE,
    TARGET_HEADER,
    ProcessingRequest,
    ProcessingResponse,
)
from extproc.adapter.phases import Phase, RequestStream
from extproc.adapter.routing import Router
from extproc.config import RouterConfig

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")


def make_router(**settings) -> Router:
    return Router(RouterConfig(hosts=settings.pop("hosts", HOSTS), **settings), random.Random(7))


def target_header(response: ProcessingResponse, phase: str) -> str:
    common = getattr(response, phase).response
    (option,) = common.header_mutation.set_headers
    assert option.header.key == TARGET_HEADER
    assert option.header.value == ""  # raw_value only: .value makes Envoy send ""
    return option.header.raw_value.decode()


def metadata_targets(response: ProcessingResponse) -> list[str]:
    value = response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    return value.fields[LB_METADATA_KEY].string_value.split(",")


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def test_headers_are_answered_at_once_and_the_body_carries_the_decision():
    router = make_router()
    stream = RequestStream(router)
    first = stream.on_message(
        request_headers({":method": "POST", "content-type": "application/json"})
    )
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    assert stream.phase is Phase.AWAITING_BODY

    second = stream.on_message(request_body(chat_body("hello " * 400)))
    assert second.WhichOneof("response") == "request_body"
    primary = target_header(second, "request_body")
    targets = metadata_targets(second)
    assert targets[0] == primary
    assert set(targets) == set(HOSTS)  # primary + 2 failover hosts
    assert router.in_flight.snapshot() == {primary: 1}

    stream.close()
    stream.close()  # idempotent: released exactly once
    assert router.in_flight.total() == 0
    assert stream.phase is Phase.CLOSED


def test_a_bodyless_request_is_decided_on_its_headers():
    router = make_router()
    stream = RequestStream(router)
    response = stream.on_message(request_headers({":method": "GET"}, end_of_stream=True))
    assert target_header(response, "request_headers") in HOSTS
    assert stream.phase is Phase.DECIDED


def test_same_prefix_same_host_different_tail():
    router = make_router()
    primaries: dict[int, set[str]] = {}
    # Ten documents asked four times each, interleaved: none is hot enough to be spread.
    for question in range(4):
        for doc in range(10):
            stream = RequestStream(router)
            stream.on_message(request_headers({}))
            body = chat_body(f"document {doc} " * 600 + f"question {question}")
            primary = target_header(stream.on_message(request_body(body)), "request_body")
            primaries.setdefault(doc, set()).add(primary)
            stream.close()
    assert all(len(hosts) == 1 for hosts in primaries.values())
    assert len(set().union(*primaries.values())) > 1  # and the documents spread


def test_overflow_at_threshold_moves_to_the_next_host():
    router = make_router(concurrency_threshold=2)
    body = chat_body("hot prefix " * 300)
    streams, primaries = [], []
    for _ in range(5):
        stream = RequestStream(router)
        stream.on_message(request_headers({}))
        primaries.append(target_header(stream.on_message(request_body(body)), "request_body"))
        streams.append(stream)
    assert primaries[0] == primaries[1] != primaries[2] == primaries[3]
    assert primaries[4] not in primaries[:4]
    for stream in streams:
        stream.close()
    assert router.in_flight.total() == 0


def test_out_of_order_messages_are_answered_not_fatal():
    router = make_router()
    stream = RequestStream(router)
    # Body before headers: still routed.
    response = stream.on_message(request_body(b"raw"))
    assert target_header(response, "request_body") in HOSTS
    # A second body and duplicate headers get do-nothing answers of their own kind.
    assert stream.on_message(request_body(b"more")).WhichOneof("response") == "request_body"
    assert stream.on_message(request_headers({})).WhichOneof("response") == "request_headers"
    assert stream.on_message(ProcessingRequest()) is None
    trailers = ProcessingRequest()
    trailers.request_trailers.SetInParent()
    assert stream.on_message(trailers).WhichOneof("response") == "request_trailers"
    stream.close()
    assert router.in_flight.total() == 0


def test_no_hosts_answers_503_immediately():
    router = make_router(hosts=())
    stream = RequestStream(router)
    stream.on_message(request_headers({}))
    response = stream.on_message(request_body(b"{}"))
    assert response.immediate_response.status.code == 503
    stream.close()


kinds = st.sampled_from(
    ["request_headers", "request_body", "request_trailers", "response_headers", "empty"]
)


@given(st.lists(st.tuples(kinds, st.binary(max_size=300), st.booleans()), max_size=8))
@settings(max_examples=300)
def test_any_message_sequence_gets_answers_and_never_leaks_in_flight(sequence):
    router = make_router(concurrency_threshold=1)
    stream = RequestStream(router)
    for kind, payload, flag in sequence:
        if kind == "request_headers":
            request = request_headers({"x-prefix-aware-id": payload.decode("latin-1")}, flag)
        elif kind == "request_body":
            request = request_body(payload, flag)
        elif kind == "empty":
            request = ProcessingRequest()
        else:
            request = ProcessingRequest()
            getattr(request, kind).SetInParent()
        response = stream.on_message(request)
        if kind == "empty":
            assert response is None
        else:
            assert response is not None
            assert response.WhichOneof("response") in (kind, "immediate_response")
        for targets in (
            [metadata_targets(response)]
            if response and response.HasField("dynamic_metadata")
            else []
        ):
            assert set(targets) <= set(HOSTS)
    stream.close()
    assert router.in_flight.total() == 0
