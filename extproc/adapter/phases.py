"""The per-stream ext_proc phase machine.

One instance per HTTP request. Envoy sends the request headers, then the body in one of
two ways, and the stream's first message says which (``protocol_config``):

- BUFFERED_PARTIAL: one body message holding the first bytes of the body. The router
  answers the headers at once and puts its decision in the body response: two round trips.
- STREAMED with ``send_body_without_waiting_for_header_response``: Envoy sends the body
  chunks without waiting for the headers response. The router holds that response until
  the body has ended and puts its decision, made on the first ``BODY_LIMIT_BYTES``, in
  it: one round trip, and the stream is over. Envoy would close it after the last body response
  anyway, so the router closes it at once and Envoy forwards the body it holds.

- FULL_DUPLEX_STREAMED (the Inference Extension's gateways): Envoy streams the body and
  forwards only what the router echoes back. The router holds the headers response until
  it has ``BODY_LIMIT_BYTES`` of body, the end of it, or ``DUPLEX_HOLD_S`` has passed,
  answers the headers with its decision, then echoes every chunk in order (and the
  response's, when Envoy streams that too). The stream lives as long as the request.

In epp mode (``epp.py``) the decision is written as an endpoint picker writes it, a
gateway's subset hint limits the choice (503 when nothing in it is eligible), and the
served endpoint reported with the response headers corrects the accounting.

A request with no body (headers with end_of_stream) is decided on the headers, and so is
every request of a stream opened while the router was shedding (its event loop running too
far behind, ``adapter/lag.py``, or ``shed_backlog`` streams already waiting for their
decisions): the least loaded host, and the stream ends there, so Envoy sends no body and
waits for nothing more. A body over ``max_body_bytes`` (by its
content-length, or by what has arrived) is refused at once: Envoy answers 413. A stream
that is over at its decision (STREAMED, ``end_at_decision``, or shed) hands the decision
to the load feed instead of counting it until the response ends. A message that arrives
out of order is a counted protocol error, never a crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

import structlog
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody

from extproc import metrics
from extproc.adapter import epp, messages
from extproc.adapter.routing import Placement, Router
from extproc.errors import NoHostsError, StreamAborted
from extproc.picker.decide import Decision
from extproc.picker.hosts import HostSet

log = structlog.get_logger("ext_proc")

# In STREAMED mode the router, not Envoy, buffers the body; it keeps this much of a larger
# one to decide on. It still waits for the end: Envoy 1.40 sent 6 of 40 bodies of 8 MiB
# upstream with chunks twice when the stream closed while the body was still arriving.
BODY_LIMIT_BYTES = 1024 * 1024
_STREAMED = ProcessingMode.STREAMED
_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
# FULL_DUPLEX_STREAMED: the longest the headers response waits for more body. Envoy's
# message_timeout (5 s at kgateway and the AI Gateway) runs on it, and no extension of it
# is possible in this mode, so a slow upload is decided on what has arrived by then.
DUPLEX_HOLD_S = 1.0
# How long, from the latest body chunk, Envoy waits for the held headers' answer
# (bounded by the filter's max_message_timeout).
HOLD_TIMEOUT_S = 30

Responses = tuple[messages.ProcessingResponse, ...]
_Routed = TypeVar("_Routed")
_NONE: Responses = ()


def _declared_length(headers: dict[str, str]) -> int:
    """The body's content-length, or 0 when absent or not a number (chunked uploads)."""
    value = headers.get("content-length", "")
    if not (value.isascii() and value.isdigit()):
        return 0
    return int(value) if len(value) <= 18 else 10**18  # no int() of a 5,000-digit string


class Phase(Enum):
    # Nothing seen yet: the next message should be the request headers.
    AWAITING_HEADERS = "awaiting_headers"
    # Headers answered; the decision waits for the first body chunk.
    AWAITING_BODY = "awaiting_body"
    # Headers unanswered while the body streams in; the decision will answer them.
    HOLDING_HEADERS = "holding_headers"
    # Decision sent (or the request was refused); later messages are passed through.
    DECIDED = "decided"
    # The stream ended; in-flight accounting has been released.
    CLOSED = "closed"


class RequestStream:
    def __init__(
        self,
        router: Router,
        end_at_decision: bool = False,
        shed: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._end_at_decision = end_at_decision
        # The router runs too far behind: decide on the headers and end the stream, so
        # Envoy sends no body and waits for no second answer.
        self._shed = shed
        self._clock = clock
        self.phase = Phase.AWAITING_HEADERS
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._body_bytes = 0  # of a STREAMED body so far
        self._streamed = False
        # FULL_DUPLEX_STREAMED: the chunks held until the decision, all echoed after it.
        self._duplex = False
        self._duplex_response = False
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._hold_until: float | None = None
        self._max_body = router.config.max_body_bytes
        self._epp = router.config.epp
        # epp mode: the hosts this request may go to (None: all), from the gateway's hint.
        self._within: HostSet | None = None
        self._placement: Placement | None = None
        self.decision: Decision | None = None

    @property
    def ended(self) -> bool:
        """Nothing more is owed to Envoy: the service may close the stream now."""
        return self.phase is Phase.DECIDED and self._ends_at_decision

    @property
    def settled(self) -> bool:
        """Decided (or refused, or closed): nothing more to decide on this stream."""
        return self.phase in (Phase.DECIDED, Phase.CLOSED)

    @property
    def decide_by(self) -> float | None:
        """When (``clock`` time) a held FULL_DUPLEX_STREAMED decision is due though the
        body has not finished; None when nothing waits on a deadline."""
        return self._hold_until if self.phase is Phase.HOLDING_HEADERS else None

    @property
    def _ends_at_decision(self) -> bool:
        if self._duplex:  # every later chunk must still be echoed
            return self._end_at_decision and self.decision is None
        return self._end_at_decision or self._streamed

    def on_message(self, request: messages.ProcessingRequest) -> Responses:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(request)
        if kind == "request_body":
            return self._on_request_body(request)
        if kind == "response_headers":
            return self._on_response_headers(request)
        if kind == "response_body" and self._duplex_response:
            body = request.response_body
            return tuple(messages.echo_body(kind, body.body, body.end_of_stream))
        if kind == "request_trailers" and self.phase is Phase.HOLDING_HEADERS and self._duplex:
            # The body ended with trailers: decide on it, then answer them.
            return (*self._decide_held(), messages.continue_for(kind))
        if kind is None:
            self._protocol_error("empty_message")
            return _NONE
        # Trailers and the response body: nothing to change; pass through.
        return (messages.continue_for(kind),)

    def on_deadline(self) -> Responses:
        """``decide_by`` has passed: decide on the body held so far, and echo it."""
        if self.decide_by is None:
            return _NONE
        return self._decide_held()

    def _on_request_headers(self, request: messages.ProcessingRequest) -> Responses:
        if self.phase is not Phase.AWAITING_HEADERS:
            self._protocol_error("duplicate_request_headers")
            return (messages.continue_for("request_headers"),)
        self._headers = messages.headers_of(request.request_headers)
        config = request.protocol_config
        self._duplex = config.request_body_mode == _DUPLEX
        self._duplex_response = config.response_body_mode == _DUPLEX
        if _declared_length(self._headers) > self._max_body:
            return (self._refuse_too_large(),)
        if self._epp:
            refused = self._limit_to_gateway_subset(request)
            if refused is not None:
                return (refused,)
        if self._shed and self._epp:
            # The protocol's answer for an overloaded picker: the gateway may retry.
            metrics.SHED.inc()
            metrics.REFUSED.labels("shed").inc()
            self.phase = Phase.DECIDED
            self._end_at_decision = True
            return (messages.too_many_requests("prefix_router_shed"),)
        if request.request_headers.end_of_stream:
            return (self._decide(b"", messages.route_on_headers),)
        if self._shed and not self._duplex and self._within is None:
            shed = self._decide_shed()
            if shed is not None:
                return (shed,)
        if self._duplex:
            self.phase = Phase.HOLDING_HEADERS
            self._hold_until = self._clock() + DUPLEX_HOLD_S
            return _NONE
        if (
            config.request_body_mode == _STREAMED
            and config.send_body_without_waiting_for_header_response
        ):
            self._streamed = True
            self.phase = Phase.HOLDING_HEADERS
            return _NONE
        self.phase = Phase.AWAITING_BODY
        return (messages.continue_for("request_headers"),)

    def _limit_to_gateway_subset(
        self, request: messages.ProcessingRequest
    ) -> messages.ProcessingResponse | None:
        """epp mode: keep to the gateway's subset hint (and, for conformance runs, the
        test header's endpoints); a 503 response when nothing there is eligible."""
        published = self._router.hosts
        hint = epp.subset_hint(request)
        within = None if hint is None else epp.eligible(published, hint)
        chosen = self._headers.get(epp.SELECTION_HEADER)
        if chosen is not None and self._router.config.epp_conformance_hooks:
            pool = within if within is not None else published
            within = epp.eligible(pool, epp.selection(chosen, pool))
        if within is not None and not within.hosts:
            metrics.REFUSED.labels("no_eligible_endpoint").inc()
            self.phase = Phase.DECIDED
            self._end_at_decision = True
            return messages.unavailable("prefix_router_no_eligible_endpoint")
        self._within = within
        return None

    def _on_request_body(self, request: messages.ProcessingRequest) -> Responses:
        body = request.request_body
        if self._duplex:
            return self._on_duplex_body(body)
        if self.phase is Phase.HOLDING_HEADERS:
            self._body_bytes += len(body.body)
            if self._body_bytes > self._max_body:
                return (self._refuse_too_large(),)
            room = BODY_LIMIT_BYTES - len(self._body)
            if room > 0:
                self._body += body.body[:room]
            if not body.end_of_stream:
                # Envoy's message_timeout runs from the headers: a client still sending
                # must not turn into a timeout (which damaged the body, failing open).
                return (messages.extend_timeout(HOLD_TIMEOUT_S),)
            decided = self._decide(bytes(self._body), messages.route_on_headers)
            self._body = bytearray()
            return (decided,)
        if self.phase is Phase.AWAITING_HEADERS:
            # Still route it, on the body alone.
            self._protocol_error("body_before_headers")
        elif self.phase is not Phase.AWAITING_BODY:
            self._protocol_error("body_after_decision")
            return (messages.continue_for("request_body"),)
        if len(body.body) > self._max_body:
            return (self._refuse_too_large(),)
        return (self._decide(body.body, messages.route_on_body),)

    def _on_duplex_body(self, body: HttpBody) -> Responses:
        if self.phase is Phase.HOLDING_HEADERS:
            self._held.append(body.body)
            self._held_bytes += len(body.body)
            if body.end_of_stream or self._held_bytes >= BODY_LIMIT_BYTES:
                return self._decide_held(body.end_of_stream)
            return _NONE
        if self.phase is Phase.DECIDED:
            return tuple(messages.echo_body("request_body", body.body, body.end_of_stream))
        self._protocol_error("body_before_headers")
        return tuple(messages.echo_body("request_body", body.body, body.end_of_stream))

    def _decide_held(self, end_of_stream: bool = False) -> Responses:
        """FULL_DUPLEX_STREAMED: answer the held headers with the decision, made on the
        first ``BODY_LIMIT_BYTES`` held, then echo every held chunk in order."""
        held, self._held, self._held_bytes = self._held, [], 0
        prefix = bytearray()
        for chunk in held:
            if len(prefix) >= BODY_LIMIT_BYTES:
                break
            prefix += chunk[: BODY_LIMIT_BYTES - len(prefix)]
        responses = [self._decide(bytes(prefix), messages.route_on_headers)]
        for number, chunk in enumerate(held, 1):
            last = end_of_stream and number == len(held)
            responses.extend(messages.echo_body("request_body", chunk, last))
        return tuple(responses)

    def _on_response_headers(self, request: messages.ProcessingRequest) -> Responses:
        echo: tuple[tuple[str, str], ...] = ()
        if self._epp and self._placement is not None:
            served = epp.served_endpoint(request)
            if served is not None:
                self.decision = self._router.served(self._placement, served)
                self._placement = None  # once: a repeated message must not move it again
                if self._router.config.epp_conformance_hooks:
                    echo = ((epp.SERVED_RESPONSE_HEADER, served),)
        return (messages.headers_with("response_headers", echo),)

    def _destination(self, decision: Decision) -> messages.Destination:
        if not self._epp:
            return messages.destination(decision)
        config = self._router.config
        extra: tuple[tuple[str, str], ...] = ()
        if config.epp_conformance_hooks and epp.SELECTION_HEADER in self._headers:
            extra = ((epp.ECHO_SET_HEADER, f"{epp.SERVED_RESPONSE_HEADER}:{decision.primary}"),)
        return messages.epp_destination(decision, config.epp_endpoint_list, extra)

    def _decide(
        self,
        body: bytes,
        respond: Callable[[messages.Destination, str | None], messages.ProcessingResponse],
    ) -> messages.ProcessingResponse:
        self.phase = Phase.DECIDED
        within = self._within
        placement = self._routed(lambda: self._router.place(self._headers, body, within))
        assert placement is not None
        self._placement = placement
        decision = self.decision = placement.decision
        where = self._destination(decision)
        if self._ends_at_decision:
            return respond(where, self._router.hand_off(decision))
        return respond(where, None)

    def _decide_shed(self) -> messages.ProcessingResponse | None:
        decision = self._routed(self._router.route_shed)
        if decision is None:
            return None
        self.phase = Phase.DECIDED
        self.decision = decision
        self._end_at_decision = True  # Envoy goes on without the router: no body comes
        where = self._destination(decision)
        return messages.route_on_headers(where, self._router.hand_off(decision))

    def _refuse_too_large(self) -> messages.ProcessingResponse:
        """Over max_body_bytes: Envoy answers 413 and the stream is over, nothing routed."""
        metrics.REFUSED.labels("body_too_large").inc()
        self.phase = Phase.DECIDED
        self._end_at_decision = True
        return messages.refuse_too_large(self._max_body)

    def _routed(self, route: Callable[[], _Routed]) -> _Routed:
        try:
            return route()
        except NoHostsError:
            metrics.FALLBACKS.labels("no_hosts").inc()
            log.warning("no_hosts")
            raise StreamAborted("prefix_router_no_hosts") from None

    def _protocol_error(self, kind: str) -> None:
        metrics.PROTOCOL_ERRORS.labels(kind).inc()
        log.warning("protocol_error", kind=kind, phase=self.phase.value)

    def close(self) -> None:
        """Release the request's in-flight slot; safe to call more than once."""
        counted = self.phase is not Phase.CLOSED and not self._ends_at_decision
        if counted and self.decision is not None:
            self._router.finish(self.decision)
        self.phase = Phase.CLOSED
