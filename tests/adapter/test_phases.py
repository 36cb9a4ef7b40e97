"""The ext_proc phase machine, driven with real protobuf messages and no sockets."""

from __future__ import annotations

import json
import random

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from extproc.adapter.completions import TICKET_KEY
from extproc.adapter.messages import (
    LB_METADATA_KEY,
    LB_METADATA_NAMESPACE,
    TARGET_HEADER,
    ProcessingRequest,
    ProcessingResponse,
)
from extproc.adapter.phases import (
    BODY_LIMIT_BYTES,
    DUPLEX_HOLD_S,
    HOLD_TIMEOUT_S,
    BodyMode,
    Phase,
    RequestStream,
)
from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.errors import StreamAborted
from extproc.picker.decide import Decision, Outcome
from extproc.picker.hosts import Host, HostSet

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


def is_timeout_extension(responses: tuple[ProcessingResponse, ...]) -> bool:
    """One message that answers nothing and gives Envoy's message_timeout HOLD_TIMEOUT_S."""
    (response,) = responses
    return (
        response.WhichOneof("response") is None
        and response.override_message_timeout.seconds == HOLD_TIMEOUT_S
        and not response.HasField("dynamic_metadata")
    )


def kinds_of(responses: tuple[ProcessingResponse, ...]) -> list[str]:
    return [r.WhichOneof("response") for r in responses]


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def test_headers_are_answered_at_once_and_the_body_carries_the_decision():
    router = make_router()
    stream = RequestStream(router)
    (first,) = stream.on_message(
        request_headers({":method": "POST", "content-type": "application/json"})
    )
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    assert stream.phase is Phase.AWAITING_BODY

    (second,) = stream.on_message(request_body(chat_body("hello " * 400)))
    assert second.WhichOneof("response") == "request_body"
    primary = target_header(second, "request_body")
    targets = metadata_targets(second)
    assert targets[0] == primary
    assert set(targets) == set(HOSTS)  # primary + 2 failover hosts
    assert router.ledger.in_flight.snapshot() == {primary: 1}

    stream.close()
    stream.close()  # idempotent: released exactly once
    assert router.ledger.in_flight.total() == 0
    assert stream.phase is Phase.CLOSED


def test_a_bodyless_request_is_decided_on_its_headers():
    router = make_router()
    stream = RequestStream(router)
    (response,) = stream.on_message(request_headers({":method": "GET"}, end_of_stream=True))
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
            (answer,) = stream.on_message(request_body(body))
            primary = target_header(answer, "request_body")
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
        (answer,) = stream.on_message(request_body(body))
        primaries.append(target_header(answer, "request_body"))
        streams.append(stream)
    assert primaries[0] == primaries[1] != primaries[2] == primaries[3]
    assert primaries[4] not in primaries[:4]
    for stream in streams:
        stream.close()
    assert router.ledger.in_flight.total() == 0


def test_out_of_order_messages_are_answered_not_fatal():
    router = make_router()
    stream = RequestStream(router)
    # Body before headers: still routed.
    (response,) = stream.on_message(request_body(b"raw"))
    assert target_header(response, "request_body") in HOSTS
    # A second body and duplicate headers get do-nothing answers of their own kind.
    assert kinds_of(stream.on_message(request_body(b"more"))) == ["request_body"]
    assert kinds_of(stream.on_message(request_headers({}))) == ["request_headers"]
    assert stream.on_message(ProcessingRequest()) == ()
    trailers = ProcessingRequest()
    trailers.request_trailers.SetInParent()
    assert kinds_of(stream.on_message(trailers)) == ["request_trailers"]
    stream.close()
    assert router.ledger.in_flight.total() == 0


def test_no_hosts_aborts_the_stream_so_envoys_failure_mode_decides():
    router = make_router(hosts=())
    stream = RequestStream(router)
    stream.on_message(request_headers({}))
    with pytest.raises(StreamAborted) as aborted:
        stream.on_message(request_body(b"{}"))
    assert aborted.value.reason == "prefix_router_no_hosts"
    stream.close()
    assert router.ledger.in_flight.total() == 0


kinds = st.sampled_from(
    ["request_headers", "request_body", "request_trailers", "response_headers", "empty"]
)


@given(
    st.lists(st.tuples(kinds, st.binary(max_size=300), st.booleans()), max_size=8), st.booleans()
)
@settings(max_examples=300)
def test_any_message_sequence_gets_answers_and_never_leaks_in_flight(sequence, shed):
    router = make_router(concurrency_threshold=1)
    stream = RequestStream(router, shed=shed)
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
        answers = stream.on_message(request)
        if kind == "empty":
            assert answers == ()
            continue
        (response,) = answers
        assert response.WhichOneof("response") == kind
        if response.HasField("dynamic_metadata"):
            assert set(metadata_targets(response)) <= set(HOSTS)
    stream.close()
    assert router.ledger.in_flight.total() == 0


# ---------------------------------------------------------------- STREAMED, headers held


def test_streamed_body_holds_the_headers_and_answers_once_with_the_decision():
    clock = [100.0]
    router = Router(RouterConfig(hosts=HOSTS), random.Random(7), clock=lambda: clock[0])
    stream = RequestStream(router)
    assert stream.on_message(request_headers({}, streamed=True)) == ()
    assert stream.phase is Phase.HOLDING_HEADERS
    body = chat_body("a shared document " * 300 + "and a question")
    half = len(body) // 2
    # Chunks before the end wait: no answer comes before the headers', only a longer
    # message_timeout for them while the body is still arriving.
    assert is_timeout_extension(stream.on_message(request_body(body[:half], end_of_stream=False)))
    answers = stream.on_message(request_body(body[half:]))
    # One answer: the decision, on the headers. Envoy forwards the chunks it holds.
    assert kinds_of(answers) == ["request_headers"]
    primary = target_header(answers[0], "request_headers")
    assert metadata_targets(answers[0])[0] == primary
    assert stream.ended
    # Handed to the load feed: Envoy would end the stream after the body anyway.
    stream.close()
    assert router.ledger.in_flight.total() == 0
    assert dict(router.ledger.unseen.counts(clock[0])) == {primary: 1}
    # It decided on the whole body: the same host as the body sent in one message.
    whole = RequestStream(make_router())
    whole.on_message(request_headers({}))
    (answer,) = whole.on_message(request_body(body))
    assert target_header(answer, "request_body") == primary


def test_streamed_body_keeps_the_first_limit_bytes_and_decides_at_the_end():
    router = make_router()
    stream = RequestStream(router)
    stream.on_message(request_headers({}, streamed=True))
    head = chat_body("a long shared document " * 100)
    chunk = b"x" * BODY_LIMIT_BYTES
    assert is_timeout_extension(stream.on_message(request_body(head, end_of_stream=False)))
    # Past the limit: nothing more is kept, and still no answer before the body ends.
    assert is_timeout_extension(stream.on_message(request_body(chunk, end_of_stream=False)))
    assert is_timeout_extension(stream.on_message(request_body(chunk, end_of_stream=False)))
    (answer,) = stream.on_message(request_body(b"tail", end_of_stream=True))
    assert stream.ended
    # The decision is the one the first BODY_LIMIT_BYTES give.
    alone = RequestStream(make_router())
    alone.on_message(request_headers({}))
    (expected,) = alone.on_message(request_body((head + chunk)[:BODY_LIMIT_BYTES]))
    assert target_header(answer, "request_headers") == target_header(expected, "request_body")
    stream.close()


def test_end_at_decision_hands_the_request_to_the_load_feed():
    clock = [100.0]
    router = Router(RouterConfig(hosts=HOSTS), random.Random(7), clock=lambda: clock[0])
    stream = RequestStream(router, end_at_decision=True)
    stream.on_message(request_headers({}, streamed=True))
    (answer,) = stream.on_message(request_body(chat_body("hello " * 400)))
    # Only the decision: the body chunks are Envoy's to forward once the stream closes.
    primary = target_header(answer, "request_headers")
    assert stream.ended
    stream.close()
    # Not counted in flight until a stream ends, but unseen by the feed for a while.
    assert router.ledger.in_flight.total() == 0
    assert dict(router.ledger.unseen.counts(clock[0])) == {primary: 1}
    clock[0] += router.config.load_feed_max_age_s + 0.1
    assert dict(router.ledger.unseen.counts(clock[0])) == {}


def test_end_at_decision_in_buffered_partial_mode_ends_after_the_body_response():
    router = make_router()
    stream = RequestStream(router, end_at_decision=True)
    assert kinds_of(stream.on_message(request_headers({}))) == ["request_headers"]
    assert not stream.ended
    (answer,) = stream.on_message(request_body(chat_body("hi")))
    assert target_header(answer, "request_body") in HOSTS
    assert stream.ended
    stream.close()
    assert router.ledger.in_flight.total() == 0
    assert router.ledger.unseen.total() == 1


@given(
    st.lists(st.tuples(kinds, st.binary(max_size=300), st.booleans()), max_size=8),
    st.booleans(),
)
@settings(max_examples=300)
def test_any_sequence_after_streamed_headers_decides_at_most_once(sequence, end_at_decision):
    router = make_router(concurrency_threshold=1)
    stream = RequestStream(router, end_at_decision)
    answers = list(stream.on_message(request_headers({}, streamed=True)))
    for kind, payload, flag in sequence:
        if stream.ended:
            break
        if kind == "request_headers":
            request = request_headers({}, flag, streamed=True)
        elif kind == "request_body":
            request = request_body(payload, flag)
        else:
            request = ProcessingRequest()
            if kind != "empty":
                getattr(request, kind).SetInParent()
        answers.extend(stream.on_message(request))
    decisions = [a for a in answers if a.HasField("dynamic_metadata")]
    assert len(decisions) <= 1
    for decision in decisions:
        assert set(metadata_targets(decision)) <= set(HOSTS)
    stream.close()
    assert router.ledger.in_flight.total() == 0


def test_a_streamed_decision_carries_a_ticket_while_the_access_log_is_connected():
    router = make_router()
    router.ledger.completions.streams = 1
    stream = RequestStream(router)
    stream.on_message(request_headers({}, streamed=True))
    (answer,) = stream.on_message(request_body(chat_body("hello " * 400)))
    namespace = answer.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    ticket = namespace.fields[TICKET_KEY].string_value
    primary = target_header(answer, "request_headers")
    stream.close()
    # The stream is gone; the request is still in flight until Envoy logs it done.
    assert router.ledger.in_flight.snapshot() == {primary: 1}
    assert router.ledger.complete(ticket)
    assert router.ledger.in_flight.total() == 0


def shed_count() -> float:
    return REGISTRY.get_sample_value("prefix_router_shed_total") or 0.0


@pytest.mark.parametrize("streamed", [False, True])
def test_a_shed_stream_is_decided_on_its_headers_by_load_and_ends_there(streamed):
    router = make_router()
    router.ledger.in_flight.acquire(HOSTS[0])  # the two others are idle
    router.ledger.in_flight.acquire(HOSTS[1])
    before = shed_count()
    stream = RequestStream(router, shed=True)
    (answer,) = stream.on_message(
        request_headers({"content-type": "application/json"}, streamed=streamed)
    )
    primary = target_header(answer, "request_headers")
    assert primary == HOSTS[2]
    assert metadata_targets(answer)[0] == primary
    assert stream.ended and stream.phase is Phase.ENDED
    assert stream.decision is not None and stream.decision.outcome is Outcome.SHED
    assert shed_count() == before + 1
    # A body Envoy had already sent is passed through, not decided again.
    assert kinds_of(stream.on_message(request_body(chat_body("late")))) == ["request_body"]
    stream.close()
    # Handed to the load feed at once, like any stream that ends with its decision.
    assert router.ledger.in_flight.snapshot() == {HOSTS[0]: 1, HOSTS[1]: 1}
    assert dict(router.ledger.unseen.counts(router._clock())) == {primary: 1}


def test_a_fleet_whose_hosts_serve_different_models_is_not_shed():
    router = make_router()
    router.set_hosts(
        HostSet.of_hosts(
            [
                Host.of(HOSTS[0], frozenset({"base", "adapter"})),
                Host.of(HOSTS[1], frozenset({"base"})),
            ]
        )
    )
    stream = RequestStream(router, shed=True)
    assert kinds_of(stream.on_message(request_headers({}))) == ["request_headers"]
    assert stream.phase is Phase.AWAITING_BODY  # the body's model decides, as always
    stream.on_message(request_body(chat_body("hello")))
    assert stream.decision is not None and stream.decision.outcome is not Outcome.SHED


def test_shedding_with_no_hosts_aborts_the_stream():
    router = make_router(hosts=(), control_plane="127.0.0.1:18000")
    router.set_hosts(HostSet(()))
    stream = RequestStream(router, shed=True)
    with pytest.raises(StreamAborted):
        stream.on_message(request_headers({}))


# ---------------------------------------------------------------- bodies over max_body_bytes

MAX_BODY = 1024 * 1024


def refused() -> float:
    return (
        REGISTRY.get_sample_value("prefix_router_refused_total", {"reason": "body_too_large"})
        or 0.0
    )


def assert_refused_413(response: ProcessingResponse, stream: RequestStream) -> None:
    assert response.immediate_response.status.code == 413
    assert json.loads(response.immediate_response.body)["error"]["code"] == 413
    assert stream.ended and stream.decision is None


@pytest.mark.parametrize("streamed", [False, True])
def test_a_declared_length_over_the_limit_is_refused_at_the_headers(streamed):
    router = make_router(max_body_bytes=MAX_BODY)
    stream = RequestStream(router)
    before = refused()
    headers = {":method": "POST", "content-length": str(MAX_BODY + 1)}
    (response,) = stream.on_message(request_headers(headers, streamed=streamed))
    assert_refused_413(response, stream)
    assert refused() == before + 1
    stream.close()
    assert router.ledger.in_flight.total() == 0


@pytest.mark.parametrize("length", ["", "abc", "-5", "\u00b2", "9" * 5000])
def test_a_missing_or_odd_content_length_is_not_a_refusal_by_itself(length):
    stream = RequestStream(make_router(max_body_bytes=MAX_BODY))
    responses = stream.on_message(request_headers({"content-length": length}))
    if length == "9" * 5000:  # digits, and far over: refused without converting them all
        assert_refused_413(responses[0], stream)
    else:
        assert not stream.ended and stream.phase is Phase.AWAITING_BODY


def test_a_partial_body_over_the_limit_is_refused():
    """BUFFERED_PARTIAL: Envoy sends what it buffered; more than the limit is refused."""
    stream = RequestStream(make_router(max_body_bytes=MAX_BODY))
    stream.on_message(request_headers({":method": "POST"}))
    (response,) = stream.on_message(request_body(b"a" * (MAX_BODY + 1), end_of_stream=False))
    assert_refused_413(response, stream)


def test_a_body_at_the_limit_is_routed():
    stream = RequestStream(make_router(max_body_bytes=MAX_BODY))
    stream.on_message(request_headers({":method": "POST", "content-length": str(MAX_BODY)}))
    (response,) = stream.on_message(request_body(b"a" * MAX_BODY))
    assert response.request_body.response.header_mutation.set_headers
    assert stream.decision is not None


def test_a_streamed_body_is_refused_once_more_than_the_limit_has_arrived():
    stream = RequestStream(make_router(max_body_bytes=MAX_BODY))
    stream.on_message(request_headers({":method": "POST"}, streamed=True))
    chunk = b"a" * (MAX_BODY // 4)
    for _ in range(4):  # exactly the limit so far: still reading
        (response,) = stream.on_message(request_body(chunk, end_of_stream=False))
        assert response.HasField("override_message_timeout")
    (response,) = stream.on_message(request_body(b"a", end_of_stream=False))
    assert_refused_413(response, stream)


# ---------------------------------------------------------------- the phase machine

# request_headers' keywords for the protocol_config of each body mode.
ANNOUNCED = {
    BodyMode.BUFFERED: {},
    BodyMode.STREAMED: {"streamed": True},
    BodyMode.DUPLEX: {"duplex": True},
}


def headers_in(mode: BodyMode, headers: dict[str, str] | None = None, **more) -> ProcessingRequest:
    return request_headers(headers or {":method": "POST"}, **ANNOUNCED[mode], **more)


def count_finishes(router: Router, monkeypatch: pytest.MonkeyPatch) -> list[Decision]:
    """The decisions ``close`` hands to ``Router.finish``, which releases them."""
    finished: list[Decision] = []
    finish = router.finish

    def counted(decision: Decision) -> None:
        finished.append(decision)
        finish(decision)

    monkeypatch.setattr(router, "finish", counted)
    return finished


@pytest.mark.parametrize(
    ("mode", "end_at_decision", "after_headers", "after_chunk", "after_end"),
    [
        # The first body message decides; a later one is passed through.
        (BodyMode.BUFFERED, False, Phase.AWAITING_BODY, Phase.DECIDED, Phase.DECIDED),
        (BodyMode.BUFFERED, True, Phase.AWAITING_BODY, Phase.ENDED, Phase.ENDED),
        # The body's end decides, and Envoy would close the stream after it anyway.
        (BodyMode.STREAMED, False, Phase.HOLDING_HEADERS, Phase.HOLDING_HEADERS, Phase.ENDED),
        (BodyMode.STREAMED, True, Phase.HOLDING_HEADERS, Phase.HOLDING_HEADERS, Phase.ENDED),
        # Decided, never ended by stream_end: every later chunk must still be echoed.
        (BodyMode.DUPLEX, False, Phase.HOLDING_HEADERS, Phase.HOLDING_HEADERS, Phase.DECIDED),
        (BodyMode.DUPLEX, True, Phase.HOLDING_HEADERS, Phase.HOLDING_HEADERS, Phase.DECIDED),
    ],
)
def test_each_body_mode_moves_through_its_phases(
    mode, end_at_decision, after_headers, after_chunk, after_end
):
    stream = RequestStream(make_router(), end_at_decision)
    assert stream.body_mode is BodyMode.BUFFERED  # until the headers say otherwise
    stream.on_message(headers_in(mode))
    assert stream.body_mode is mode
    assert stream.phase is after_headers and not stream.settled
    stream.on_message(request_body(chat_body("hello " * 40), end_of_stream=False))
    assert stream.phase is after_chunk
    stream.on_message(request_body(b" and the end", end_of_stream=True))
    assert stream.phase is after_end
    assert stream.ended is (after_end is Phase.ENDED)
    assert stream.settled and stream.decision is not None
    stream.close()
    assert stream.phase is Phase.CLOSED and not stream.ended and stream.settled


def test_streamed_that_waits_for_the_headers_answer_is_buffered():
    """Without send_body_without_waiting_for_header_response, Envoy sends no body before
    the headers are answered: nothing to hold them for."""
    request = request_headers({":method": "POST"})
    request.protocol_config.request_body_mode = ProcessingMode.STREAMED
    stream = RequestStream(make_router())
    assert kinds_of(stream.on_message(request)) == ["request_headers"]
    assert stream.body_mode is BodyMode.BUFFERED and stream.phase is Phase.AWAITING_BODY


@pytest.mark.parametrize(
    ("mode", "end_at_decision", "phase"),
    [
        (BodyMode.BUFFERED, False, Phase.DECIDED),
        (BodyMode.BUFFERED, True, Phase.ENDED),
        # No body to end the stream: it lives on unless stream_end says otherwise.
        (BodyMode.STREAMED, False, Phase.DECIDED),
        (BodyMode.STREAMED, True, Phase.ENDED),
        (BodyMode.DUPLEX, False, Phase.DECIDED),
        (BodyMode.DUPLEX, True, Phase.DECIDED),  # the response still streams through
    ],
)
def test_a_bodyless_request_is_decided_on_its_headers_in_every_mode(mode, end_at_decision, phase):
    stream = RequestStream(make_router(), end_at_decision)
    (answer,) = stream.on_message(headers_in(mode, {":method": "GET"}, end_of_stream=True))
    assert target_header(answer, "request_headers") in HOSTS
    assert stream.phase is phase and stream.decision is not None


def duplex_trailers() -> ProcessingRequest:
    request = ProcessingRequest()
    request.request_trailers.SetInParent()
    return request


@pytest.mark.parametrize("cause", ["end", "limit", "trailers", "deadline"])
def test_a_held_duplex_decision_leaves_the_stream_decided_whatever_stream_end_says(cause):
    clock = [100.0]
    stream = RequestStream(make_router(), end_at_decision=True, clock=lambda: clock[0])
    stream.on_message(headers_in(BodyMode.DUPLEX))
    if cause == "end":
        stream.on_message(request_body(chat_body("hi"), end_of_stream=True))
    elif cause == "limit":
        stream.on_message(request_body(b"a" * BODY_LIMIT_BYTES, end_of_stream=False))
    elif cause == "trailers":
        stream.on_message(request_body(chat_body("hi"), end_of_stream=False))
        stream.on_message(duplex_trailers())
    else:
        stream.on_message(request_body(chat_body("hi"), end_of_stream=False))
        clock[0] += DUPLEX_HOLD_S
        stream.on_deadline()
    assert stream.phase is Phase.DECIDED and not stream.ended
    assert stream.decide_by is None
    # Later chunks are echoed, and the stream stays where it is.
    assert kinds_of(stream.on_message(request_body(b"more", end_of_stream=True))) == [
        "request_body"
    ]
    assert stream.phase is Phase.DECIDED


def over_the_limit_at_the_headers(mode: BodyMode) -> list[ProcessingRequest]:
    return [headers_in(mode, {":method": "POST", "content-length": str(MAX_BODY + 1)})]


# Each refusal: the router's epp setting, whether the stream sheds, and its messages.
REFUSALS = {
    **{
        f"413 at the {mode.value} headers": (False, False, over_the_limit_at_the_headers(mode))
        for mode in BodyMode
    },
    "413 on a buffered body": (
        False,
        False,
        [headers_in(BodyMode.BUFFERED), request_body(b"a" * (MAX_BODY + 1))],
    ),
    "413 on a streamed body": (
        False,
        False,
        [
            headers_in(BodyMode.STREAMED),
            request_body(b"a" * MAX_BODY, end_of_stream=False),
            request_body(b"a", end_of_stream=False),
        ],
    ),
    **{
        f"503 for an ineligible {mode.value} subset": (
            True,
            False,
            [headers_in(mode, hint=["127.0.0.99:8000"])],
        )
        for mode in BodyMode
    },
    "429 from a shedding picker": (True, True, [headers_in(BodyMode.DUPLEX)]),
}


@pytest.mark.parametrize("end_at_decision", [False, True])
@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_stream_is_ended_with_nothing_to_release(refusal, end_at_decision, monkeypatch):
    epp, shed, requests = REFUSALS[refusal]
    router = make_router(max_body_bytes=MAX_BODY, epp=epp)
    finished = count_finishes(router, monkeypatch)
    stream = RequestStream(router, end_at_decision, shed=shed)
    *before, last = requests
    for request in before:
        stream.on_message(request)
        assert not stream.settled
    (response,) = stream.on_message(last)
    assert response.WhichOneof("response") == "immediate_response"
    assert stream.phase is Phase.ENDED and stream.ended and stream.settled
    assert stream.decision is None
    stream.close()
    assert finished == [] and router.ledger.in_flight.total() == 0


@pytest.mark.parametrize("mode", [BodyMode.BUFFERED, BodyMode.STREAMED])
def test_a_shed_decision_ends_the_stream(mode):
    stream = RequestStream(make_router(), shed=True)
    stream.on_message(headers_in(mode))
    assert stream.phase is Phase.ENDED
    assert stream.decision is not None and stream.decision.outcome is Outcome.SHED


ENDED_WITH_A_DECISION = {
    "streamed": ({}, [headers_in(BodyMode.STREAMED), request_body(chat_body("hi"))]),
    "stream_end: decision": (
        {"end_at_decision": True},
        [headers_in(BodyMode.BUFFERED), request_body(chat_body("hi"))],
    ),
    "shed": ({"shed": True}, [headers_in(BodyMode.BUFFERED)]),
}


@pytest.mark.parametrize("how", list(ENDED_WITH_A_DECISION))
def test_close_after_an_ended_decision_finishes_nothing(how, monkeypatch):
    """The decision was handed off when the stream ended: with the access log connected it
    stays in flight until Envoy logs the request, whatever close does."""
    arguments, requests = ENDED_WITH_A_DECISION[how]
    router = make_router()
    router.ledger.completions.streams = 1
    finished = count_finishes(router, monkeypatch)
    stream = RequestStream(router, **arguments)
    for request in requests:
        stream.on_message(request)
    assert stream.phase is Phase.ENDED and stream.decision is not None
    held = router.ledger.in_flight.snapshot()
    assert held == {stream.decision.primary: 1}
    stream.close()
    stream.close()
    assert finished == [] and router.ledger.in_flight.snapshot() == held
    assert stream.phase is Phase.CLOSED


@pytest.mark.parametrize("mode", list(BodyMode))
def test_close_after_a_decided_stream_finishes_its_decision_once(mode, monkeypatch):
    router = make_router()
    finished = count_finishes(router, monkeypatch)
    # stream_end: decision leaves DUPLEX decided, so it must be released here too.
    stream = RequestStream(router, end_at_decision=mode is BodyMode.DUPLEX)
    stream.on_message(headers_in(mode, {":method": "GET"}, end_of_stream=True))
    assert stream.phase is Phase.DECIDED and stream.decision is not None
    assert router.ledger.in_flight.snapshot() == {stream.decision.primary: 1}
    stream.close()
    assert finished == [stream.decision] and router.ledger.in_flight.total() == 0
    stream.close()  # idempotent: released exactly once
    assert finished == [stream.decision] and stream.phase is Phase.CLOSED


def test_close_before_any_decision_finishes_nothing(monkeypatch):
    router = make_router()
    finished = count_finishes(router, monkeypatch)
    stream = RequestStream(router)
    stream.on_message(headers_in(BodyMode.STREAMED))
    stream.close()
    stream.close()
    assert finished == [] and stream.phase is Phase.CLOSED and stream.settled
