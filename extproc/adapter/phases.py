"""The per-stream ext_proc phase machine.

One instance per HTTP request. The request headers come first, and their message says how
Envoy will send the body (``protocol_config``), the stream's ``BodyMode``:

- BUFFERED (BUFFERED_PARTIAL): one body message holding the first bytes of the body. The
  router answers the headers at once and puts its decision in the body response: two
  round trips.
- STREAMED (with ``send_body_without_waiting_for_header_response``): Envoy sends the body
  chunks without waiting for the headers response. The router holds that response until
  the body has ended and puts its decision, made on the first ``BODY_LIMIT_BYTES``, in
  it: one round trip, and the stream is over. Envoy would close it after the last body
  response anyway, so the router closes it at once and Envoy forwards the body it holds.
- DUPLEX (FULL_DUPLEX_STREAMED, the Inference Extension's gateways): Envoy streams the
  body and forwards only what the router echoes back. The router holds the headers
  response until it has ``BODY_LIMIT_BYTES`` of body, the end of it, or ``DUPLEX_HOLD_S``
  has passed, answers the headers with its decision, then echoes every chunk in order (and
  the response's, when Envoy streams that too). The stream lives as long as the request.

The phases (``Phase``), and what moves a stream from one to the next::

    AWAITING_HEADERS --headers--> AWAITING_BODY    BUFFERED
                                  HOLDING_HEADERS  STREAMED, DUPLEX
                                  DECIDED | ENDED  no body, or shed
                                  ENDED            refused
    AWAITING_BODY    --body-----> DECIDED | ENDED  (ENDED when refused)
    HOLDING_HEADERS  --body's end---------------> ENDED    STREAMED (or refused)
                     --end, limit, trailers,
                       DUPLEX_HOLD_S------------> DECIDED  DUPLEX
    any              --close--------------------> CLOSED

DECIDED: the decision is sent and the stream lives on with the request, its host's
in-flight slot held until ``close``. ENDED: nothing more is owed to Envoy and the service
closes the stream; a decision that ends its stream (STREAMED, ``stream_end: decision``
outside DUPLEX, shed) is handed off at once (to the load feed, or to Envoy's access log),
since the stream closes before its request ends.

In epp mode (``epp.py``) the decision is written as an endpoint picker writes it, a
gateway's subset hint limits the choice (503 when nothing in it is eligible), and the
served endpoint reported with the response headers corrects the accounting.

A request with no body (headers with end_of_stream) is decided on the headers, and so is
every request of a stream opened while the router was shedding (its event loop running too
far behind, ``adapter/lag.py``, or ``shed_backlog`` streams already waiting for their
decisions): the least loaded host, and the stream ends there, so Envoy sends no body and
waits for nothing more. A body over ``max_body_bytes`` (by its content-length, or by what
has arrived) is refused at once: Envoy answers 413. A message that arrives out of order is
a counted protocol error, never a crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

import structlog
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody

from extproc.adapter import epp, messages, metrics
from extproc.adapter.routing import Placement, Router
from extproc.errors import NoHostsError, StreamAborted
from extproc.picker.decide import Decision
from extproc.picker.hosts import HostSet

log = structlog.get_logger("ext_proc")

# In STREAMED mode the router, not Envoy, buffers the body; it keeps this much of a larger
# one to decide on. It still waits for the end: Envoy 1.40 sent 6 of 40 bodies of 8 MiB
# upstream with chunks twice when the stream closed while the body was still arriving.
BODY_LIMIT_BYTES = 1024 * 1024
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


class BodyMode(Enum):
    """How Envoy sends the request body, as the request headers' message announced it."""

    # BUFFERED_PARTIAL, and any mode but the two below (STREAMED that waits for the
    # headers' answer too): the headers are answered at once, the first body message
    # carries the decision.
    BUFFERED = "buffered"
    # STREAMED with send_body_without_waiting_for_header_response: the headers' answer
    # waits for the body's end and carries the decision.
    STREAMED = "streamed"
    # FULL_DUPLEX_STREAMED: the headers' answer carries the decision once enough body
    # has arrived; Envoy forwards only the chunks echoed back.
    DUPLEX = "duplex"

    @classmethod
    def announced_in(cls, request: messages.ProcessingRequest) -> BodyMode:
        config = request.protocol_config
        if config.request_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED:
            return cls.DUPLEX
        if (
            config.request_body_mode == ProcessingMode.STREAMED
            and config.send_body_without_waiting_for_header_response
        ):
            return cls.STREAMED
        return cls.BUFFERED


class Phase(Enum):
    # Nothing seen yet; waits for the request headers, which set the body mode and move
    # the stream on (or decide, or refuse, at once). A body first is routed as BUFFERED's.
    AWAITING_HEADERS = "awaiting_headers"
    # BUFFERED: headers answered; waits for the body message, whose answer decides.
    AWAITING_BODY = "awaiting_body"
    # STREAMED, DUPLEX: the headers' answer is held while the body streams in, and will
    # carry the decision. STREAMED waits for the body's end (then ENDED); DUPLEX for the
    # end, BODY_LIMIT_BYTES, trailers or decide_by (then DECIDED).
    HOLDING_HEADERS = "holding_headers"
    # Decision sent; the stream lives on with the request, its in-flight slot held until
    # close. Later messages are passed through (DUPLEX: request chunks echoed).
    DECIDED = "decided"
    # Decided or refused, and nothing more is owed to Envoy: the stream may close now. A
    # decision is handed off on the way in, so close releases nothing.
    ENDED = "ended"
    # The stream is gone; whatever it held in flight has been released.
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
        # Config and policy, fixed for the stream's life: they choose which phase a
        # decision leads to, and are never written.
        # stream_end: decision: a decision ends the stream (outside DUPLEX).
        self._end_at_decision = end_at_decision
        # The router runs too far behind: decide on the headers and end the stream, so
        # Envoy sends no body and waits for no second answer.
        self._shed = shed
        self._clock = clock
        self.phase = Phase.AWAITING_HEADERS
        # Set once, by the request headers; a body before them is routed as a buffered one.
        self.body_mode = BodyMode.BUFFERED
        # Apart from body_mode: the response's mode only says whether its chunks are
        # echoed, and no response message moves the phase.
        self._echo_response_body = False
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._body_bytes = 0  # of a STREAMED body so far
        # DUPLEX: the chunks held until the decision, all echoed after it.
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
        return self.phase is Phase.ENDED

    @property
    def settled(self) -> bool:
        """Decided (or refused, or closed): nothing more to decide on this stream."""
        return self.phase in (Phase.DECIDED, Phase.ENDED, Phase.CLOSED)

    @property
    def decide_by(self) -> float | None:
        """When (``clock`` time) a held FULL_DUPLEX_STREAMED decision is due though the
        body has not finished; None when nothing waits on a deadline."""
        return self._hold_until if self.phase is Phase.HOLDING_HEADERS else None

    def on_message(self, request: messages.ProcessingRequest) -> Responses:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(request)
        if kind == "request_body":
            return self._on_request_body(request)
        if kind == "response_headers":
            return self._on_response_headers(request)
        if kind == "response_body" and self._echo_response_body:
            body = request.response_body
            return tuple(messages.echo_body(kind, body.body, body.end_of_stream))
        duplex = self.body_mode is BodyMode.DUPLEX
        if kind == "request_trailers" and duplex and self.phase is Phase.HOLDING_HEADERS:
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
        mode = self.body_mode = BodyMode.announced_in(request)
        response_mode = request.protocol_config.response_body_mode
        self._echo_response_body = response_mode == ProcessingMode.FULL_DUPLEX_STREAMED
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
            return (self._refuse(messages.too_many_requests("prefix_router_shed")),)
        if request.request_headers.end_of_stream:
            then = self._phase_after_decision()
            return (self._decide(b"", messages.route_on_headers, then),)
        if self._shed and mode is not BodyMode.DUPLEX and self._within is None:
            shed = self._decide_shed()
            if shed is not None:
                return (shed,)
        if mode is BodyMode.BUFFERED:
            self.phase = Phase.AWAITING_BODY
            return (messages.continue_for("request_headers"),)
        self.phase = Phase.HOLDING_HEADERS
        if mode is BodyMode.DUPLEX:
            self._hold_until = self._clock() + DUPLEX_HOLD_S
        return _NONE

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
            return self._refuse(messages.unavailable("prefix_router_no_eligible_endpoint"))
        self._within = within
        return None

    def _on_request_body(self, request: messages.ProcessingRequest) -> Responses:
        body = request.request_body
        if self.body_mode is BodyMode.DUPLEX:
            return self._on_duplex_body(body)
        if self.phase is Phase.HOLDING_HEADERS:
            return (self._on_streamed_body(body),)
        if self.phase is Phase.AWAITING_HEADERS:
            # Still route it, on the body alone.
            self._protocol_error("body_before_headers")
        elif self.phase is not Phase.AWAITING_BODY:
            self._protocol_error("body_after_decision")
            return (messages.continue_for("request_body"),)
        if len(body.body) > self._max_body:
            return (self._refuse_too_large(),)
        then = self._phase_after_decision()
        return (self._decide(body.body, messages.route_on_body, then),)

    def _on_streamed_body(self, body: HttpBody) -> messages.ProcessingResponse:
        """STREAMED: keep the first ``BODY_LIMIT_BYTES`` and answer the held headers with
        the decision once the body has ended."""
        self._body_bytes += len(body.body)
        if self._body_bytes > self._max_body:
            return self._refuse_too_large()
        room = BODY_LIMIT_BYTES - len(self._body)
        if room > 0:
            self._body += body.body[:room]
        if not body.end_of_stream:
            # Envoy's message_timeout runs from the headers: a client still sending
            # must not turn into a timeout (which damaged the body, failing open).
            return messages.extend_timeout(HOLD_TIMEOUT_S)
        # Envoy closes the stream after the last body response anyway: end it with this one.
        decided = self._decide(bytes(self._body), messages.route_on_headers, Phase.ENDED)
        self._body = bytearray()
        return decided

    def _on_duplex_body(self, body: HttpBody) -> Responses:
        if self.phase is Phase.HOLDING_HEADERS:
            self._held.append(body.body)
            self._held_bytes += len(body.body)
            if body.end_of_stream or self._held_bytes >= BODY_LIMIT_BYTES:
                return self._decide_held(body.end_of_stream)
            return _NONE
        if self.phase in (Phase.DECIDED, Phase.ENDED):
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
        # DECIDED, whatever stream_end says: every later chunk must still be echoed.
        responses = [self._decide(bytes(prefix), messages.route_on_headers, Phase.DECIDED)]
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

    def _phase_after_decision(self) -> Phase:
        """Where a decision on the headers or a BUFFERED body leaves the stream:
        ``stream_end: decision`` ends it, except in DUPLEX, where every later chunk must
        still be echoed."""
        if self._end_at_decision and self.body_mode is not BodyMode.DUPLEX:
            return Phase.ENDED
        return Phase.DECIDED

    def _decide(
        self,
        body: bytes,
        respond: Callable[[messages.Destination, str | None], messages.ProcessingResponse],
        then: Phase,
    ) -> messages.ProcessingResponse:
        """Route the request and answer with the decision; ``then`` is DECIDED or ENDED."""
        self.phase = then
        within = self._within
        placement = self._routed(lambda: self._router.place(self._headers, body, within))
        assert placement is not None
        self._placement = placement
        decision = self.decision = placement.decision
        where = self._destination(decision)
        if then is Phase.ENDED:
            # The stream closes before its request ends: the load feed (or Envoy's access
            # log) carries the request from here.
            return respond(where, self._router.hand_off(decision))
        return respond(where, None)

    def _decide_shed(self) -> messages.ProcessingResponse | None:
        decision = self._routed(self._router.route_shed)
        if decision is None:
            return None
        self.phase = Phase.ENDED  # Envoy goes on without the router: no body comes
        self.decision = decision
        where = self._destination(decision)
        return messages.route_on_headers(where, self._router.hand_off(decision))

    def _refuse(self, response: messages.ProcessingResponse) -> messages.ProcessingResponse:
        """An immediate response: Envoy answers the client itself, nothing is routed."""
        self.phase = Phase.ENDED
        return response

    def _refuse_too_large(self) -> messages.ProcessingResponse:
        """Over max_body_bytes: Envoy answers 413."""
        metrics.REFUSED.labels("body_too_large").inc()
        return self._refuse(messages.refuse_too_large(self._max_body))

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
        """Release the request's in-flight slot; safe to call more than once. Only a
        DECIDED stream holds one: an ENDED one handed its decision off when it ended."""
        if self.phase is Phase.DECIDED and self.decision is not None:
            self._router.finish(self.decision)
        self.phase = Phase.CLOSED
