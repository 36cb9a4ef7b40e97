"""Endpoint-picker mode and FULL_DUPLEX_STREAMED bodies in the phase machine, driven with
real protobuf messages and no sockets (the Envoy tests are tests/integration/test_epp_*)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from extproc.adapter import epp
from extproc.adapter.messages import (
    ECHO_CHUNK_BYTES,
    LB_METADATA_KEY,
    LB_METADATA_NAMESPACE,
    ProcessingResponse,
)
from extproc.adapter.phases import BODY_LIMIT_BYTES, DUPLEX_HOLD_S, Phase, RequestStream
from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.picker.hosts import HostSet

from ..extproc_messages import (
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
)

HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")
POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


def make_router(**settings) -> Router:
    settings.setdefault("hosts", HOSTS)
    return Router(RouterConfig(epp=settings.pop("epp", True), **settings), random.Random(7))


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def set_headers(response: ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(response, phase).response
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def destination(response: ProcessingResponse) -> tuple[str, str]:
    """The header and the envoy.lb value of an endpoint picker's decision; they must agree."""
    header = set_headers(response, "request_headers")[LB_METADATA_KEY]
    lb = response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    return header, lb.fields[LB_METADATA_KEY].string_value


def echoed(responses, kind: str = "request_body") -> tuple[bytes, list[bool]]:
    """The bytes echoed back in ``kind`` replies, and each reply's end_of_stream."""
    data, ends = b"", []
    for response in responses:
        assert response.WhichOneof("response") == kind
        streamed = getattr(response, kind).response.body_mutation.streamed_response
        assert len(streamed.body) <= ECHO_CHUNK_BYTES
        data += streamed.body
        ends.append(streamed.end_of_stream)
    return data, ends


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_duplex_holds_the_headers_until_the_body_ends_then_echoes_it_in_order():
    router = make_router()
    stream = RequestStream(router)
    assert stream.on_message(request_headers(POST, duplex=True)) == ()
    assert stream.phase is Phase.HOLDING_HEADERS
    body = chat_body("the shared document " * 10_000)  # about 200 kB, in four chunks
    chunks = [body[i : i + 60_000] for i in range(0, len(body), 60_000)]
    for chunk in chunks[:-1]:
        assert stream.on_message(request_body(chunk, end_of_stream=False)) == ()
    first, *rest = stream.on_message(request_body(chunks[-1], end_of_stream=True))
    header, metadata = destination(first)
    assert header == metadata and header in HOSTS
    assert first.request_headers.response.clear_route_cache
    data, ends = echoed(rest)
    assert data == body
    assert ends == [False] * (len(ends) - 1) + [True]
    assert stream.phase is Phase.DECIDED and not stream.ended
    assert router.ledger.in_flight.snapshot() == {header: 1}
    # Every later message is answered in kind, the response body echoed too.
    (answer,) = stream.on_message(response_headers({":status": "200"}))
    assert answer.WhichOneof("response") == "response_headers"
    data, ends = echoed(stream.on_message(response_body(b"x" * 150_000)), "response_body")
    assert data == b"x" * 150_000 and ends[-1] is True
    stream.close()
    assert router.ledger.in_flight.total() == 0


def test_duplex_decides_at_the_body_limit_and_echoes_later_chunks_one_by_one():
    stream = RequestStream(make_router())
    stream.on_message(request_headers(POST, duplex=True))
    big = b"a" * (BODY_LIMIT_BYTES + 10)
    first, *rest = stream.on_message(request_body(big, end_of_stream=False))
    assert first.WhichOneof("response") == "request_headers"
    data, ends = echoed(rest)
    assert data == big and not any(ends)
    (last,) = stream.on_message(request_body(b"tail", end_of_stream=True))
    assert echoed([last]) == (b"tail", [True])


def test_a_slow_duplex_upload_is_decided_at_the_deadline_on_what_has_arrived():
    clock = Clock()
    stream = RequestStream(make_router(), clock=clock)
    stream.on_message(request_headers(POST, duplex=True))
    assert stream.decide_by == clock.now + DUPLEX_HOLD_S
    assert stream.on_message(request_body(b'{"model": "m", "mess', end_of_stream=False)) == ()
    clock.now += DUPLEX_HOLD_S
    first, held = stream.on_deadline()
    assert destination(first)[0] in HOSTS
    assert echoed([held]) == (b'{"model": "m", "mess', [False])
    assert stream.decide_by is None and stream.on_deadline() == ()
    (more,) = stream.on_message(request_body(b'ages": []}', end_of_stream=True))
    assert echoed([more]) == (b'ages": []}', [True])


def test_duplex_body_ended_by_trailers_is_decided_then_the_trailers_answered():
    stream = RequestStream(make_router())
    stream.on_message(request_headers(POST, duplex=True))
    stream.on_message(request_body(chat_body("hi"), end_of_stream=False))
    responses = stream.on_message(request_trailers())
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds == ["request_headers", "request_body", "request_trailers"]


def test_a_bodiless_duplex_request_is_decided_on_its_headers_and_the_stream_stays_open():
    router = make_router()
    stream = RequestStream(router)
    (first,) = stream.on_message(
        request_headers({":method": "GET"}, end_of_stream=True, duplex=True)
    )
    assert destination(first)[0] in HOSTS
    assert not stream.ended  # the response still streams through the picker


def test_same_prompt_goes_to_the_same_endpoint():
    router = make_router()
    picks = set()
    for _ in range(4):
        stream = RequestStream(router)
        stream.on_message(request_headers(POST, duplex=True))
        first, *_ = stream.on_message(request_body(chat_body("doc " * 3000)))
        picks.add(destination(first)[0])
        stream.close()
    assert len(picks) == 1


@pytest.mark.parametrize("as_string", [False, True])
def test_the_subset_hint_limits_the_pick(as_string):
    hint = ["127.0.0.12:8000", "127.0.0.99:8000"]  # one published, one not
    router = make_router()
    for number in range(12):
        stream = RequestStream(router)
        stream.on_message(
            request_headers(POST, duplex=True, hint=",".join(hint) if as_string else hint)
        )
        first, *_ = stream.on_message(request_body(chat_body(f"prompt {number} " * 200)))
        assert destination(first) == ("127.0.0.12:8000", "127.0.0.12:8000")


@pytest.mark.parametrize("hint", [[], ["127.0.0.99:8000"], ["not an address"]])
def test_an_empty_or_ineligible_hint_is_answered_503(hint):
    before = counter("prefix_router_refused_total", reason="no_eligible_endpoint")
    stream = RequestStream(make_router())
    (response,) = stream.on_message(request_headers(POST, duplex=True, hint=hint))
    assert response.immediate_response.status.code == 503
    assert stream.ended
    assert counter("prefix_router_refused_total", reason="no_eligible_endpoint") == before + 1


def test_without_published_hosts_the_hint_is_the_pool():
    router = make_router(hosts=())
    stream = RequestStream(router)
    stream.on_message(request_headers(POST, duplex=True, hint=["127.0.0.21:8000"]))
    first, *_ = stream.on_message(request_body(chat_body("x")))
    assert destination(first)[0] == "127.0.0.21:8000"


def test_one_endpoint_by_default_and_the_ordered_list_as_an_option():
    for endpoint_list, count in ((False, 1), (True, 3)):
        stream = RequestStream(make_router(epp_endpoint_list=endpoint_list))
        stream.on_message(request_headers(POST, duplex=True))
        first, *_ = stream.on_message(request_body(chat_body("y")))
        header, metadata = destination(first)
        assert header == metadata and len(header.split(",")) == count


def test_the_served_endpoint_moves_the_in_flight_count_and_the_prefix():
    router = make_router(failover_hosts=0)
    before = counter("prefix_router_served_elsewhere_total")
    prompt = chat_body("a long shared document " * 2000)
    stream = RequestStream(router)
    stream.on_message(request_headers(POST, duplex=True))
    first, *_ = stream.on_message(request_body(prompt))
    picked = destination(first)[0]
    served = next(h for h in HOSTS if h != picked)
    stream.on_message(response_headers({":status": "200"}, served=served))
    assert router.ledger.in_flight.snapshot().get(served) == 1
    assert router.ledger.in_flight.snapshot().get(picked, 0) == 0
    assert counter("prefix_router_served_elsewhere_total") == before + 1
    stream.close()
    assert router.ledger.in_flight.total() == 0
    # The prompt is now known on the host that served it.
    placement = router.place({}, prompt)
    assert placement.lookup is not None and placement.lookup.depth_on(served) > 0


def test_the_conformance_hook_is_off_by_default():
    stream = RequestStream(make_router())
    stream.on_message(request_headers({**POST, epp.SELECTION_HEADER: "127.0.0.13:8000"}, True))
    # Not honoured: a client must not choose the upstream (only the prompt decides).
    assert stream.decision is not None


def test_the_conformance_hook_names_the_endpoints_and_echoes_the_served_one():
    router = make_router(epp_conformance_hooks=True)
    for value, allowed in (
        ("127.0.0.13:8000", {"127.0.0.13:8000"}),
        ("127.0.0.11, 127.0.0.12:8000", {"127.0.0.11:8000", "127.0.0.12:8000"}),
    ):
        for number in range(6):
            stream = RequestStream(router)
            headers = {**POST, epp.SELECTION_HEADER: value}
            stream.on_message(request_headers(headers, duplex=True))
            first, *_ = stream.on_message(request_body(chat_body(f"p{number}")))
            picked = destination(first)[0]
            assert picked in allowed
            echo = set_headers(first, "request_headers")[epp.ECHO_SET_HEADER]
            assert echo == f"{epp.SERVED_RESPONSE_HEADER}:{picked}"
            (answer,) = stream.on_message(response_headers({}, served=picked))
            assert set_headers(answer, "response_headers") == {epp.SERVED_RESPONSE_HEADER: picked}
            stream.close()
    stream = RequestStream(router)
    headers = {**POST, epp.SELECTION_HEADER: "127.0.0.77"}
    (refused,) = stream.on_message(request_headers(headers, duplex=True))
    assert refused.immediate_response.status.code == 503


def test_eligible_keeps_published_hosts_only():
    published = HostSet.of(HOSTS)
    assert epp.eligible(published, ("127.0.0.11:8000", "10.0.0.1:1")).addresses == {
        "127.0.0.11:8000"
    }
    assert epp.eligible(HostSet.of(()), ("10.0.0.1:1",)).addresses == {"10.0.0.1:1"}


def test_router_mode_still_writes_the_target_header():
    stream = RequestStream(make_router(epp=False))
    stream.on_message(request_headers(POST, duplex=True))
    first, *_ = stream.on_message(request_body(chat_body("z")))
    assert set(set_headers(first, "request_headers")) == {"x-target-host"}


_KINDS = ("headers", "headers_eos", "body", "body_more", "trailers", "response_headers",
          "response_body", "deadline")  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(
    sequence=st.lists(st.sampled_from(_KINDS), max_size=8),
    body=st.binary(max_size=300),
    hint=st.none() | st.lists(st.sampled_from([*HOSTS, "127.0.0.99:1", "junk", ""]), max_size=4),
    served=st.none() | st.sampled_from([*HOSTS, "127.0.0.99:1", "junk"]),
    hooks=st.booleans(),
)
def test_any_duplex_sequence_echoes_every_byte_in_order_and_stays_in_the_pool(
    sequence, body, hint, served, hooks
):
    """Any order of messages, hostile bodies, hints and served endpoints: nothing but a
    counted protocol error; every request byte that arrives is echoed once, in order; no
    target outside the published hosts; the slot is released at the end."""
    router = make_router(epp_conformance_hooks=hooks)
    clock = Clock()
    stream = RequestStream(router, clock=clock)
    sent, echoed_bytes = b"", b""
    duplex = False  # a body before any headers cannot be known to be FULL_DUPLEX_STREAMED
    for kind in sequence:
        if kind == "deadline":
            clock.now += DUPLEX_HOLD_S
            responses = stream.on_deadline()
        elif kind in ("headers", "headers_eos"):
            headers = {**POST, epp.SELECTION_HEADER: "127.0.0.12"}
            request = request_headers(headers, kind == "headers_eos", duplex=True, hint=hint)
            duplex = duplex or stream.phase is Phase.AWAITING_HEADERS
            responses = stream.on_message(request)
        elif kind in ("body", "body_more"):
            responses = stream.on_message(request_body(body, kind == "body"))
            if duplex:
                sent += body
        elif kind == "trailers":
            responses = stream.on_message(request_trailers())
        elif kind == "response_headers":
            responses = stream.on_message(response_headers({}, served=served))
        else:
            responses = stream.on_message(response_body(body))
        for response in responses:
            assert response.WhichOneof("response") is not None
            if response.WhichOneof("response") == "request_body":
                streamed = response.request_body.response.body_mutation.streamed_response
                echoed_bytes += streamed.body
            if response.HasField("dynamic_metadata"):
                lb = response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
                targets = lb.fields[LB_METADATA_KEY].string_value.split(",")
                assert set(targets) <= set(HOSTS)
        if stream.ended:
            break
    assert sent.startswith(echoed_bytes)
    if stream.phase is Phase.DECIDED and not stream.ended:
        assert echoed_bytes == sent  # nothing held back once decided
    stream.close()
    assert router.ledger.in_flight.total() == 0


def test_a_shedding_picker_answers_429():
    before = counter("prefix_router_refused_total", reason="shed")
    stream = RequestStream(make_router(), shed=True)
    (response,) = stream.on_message(request_headers(POST, duplex=True))
    assert response.immediate_response.status.code == 429
    assert stream.ended
    assert counter("prefix_router_refused_total", reason="shed") == before + 1
