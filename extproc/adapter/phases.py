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

A request with no body (headers with end_of_stream) is decided on the headers, and so is
every request of a stream opened while the router was shedding (its event loop running too
far behind, ``adapter/lag.py``): the least loaded host, and the stream ends there, so
Envoy sends no body and waits for nothing more. A body over ``max_body_bytes`` (by its
content-length, or by what has arrived) is refused at once: Envoy answers 413. A stream
that is over at its decision (STREAMED, ``end_at_decision``, or shed) hands the decision
to the load feed instead of counting it until the response ends. A message that arrives
out of order is a counted protocol error, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import structlog
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from extproc import metrics
from extproc.adapter import messages
from extproc.adapter.routing import Router
from extproc.errors import NoHostsError, StreamAborted
from extproc.picker.decide import Decision

log = structlog.get_logger("ext_proc")

# In STREAMED mode the router, not Envoy, buffers the body; it keeps this much of a larger
# one to decide on. It still waits for the end: Envoy 1.40 sent 6 of 40 bodies of 8 MiB
# upstream with chunks twice when the stream closed while the body was still arriving.
BODY_LIMIT_BYTES = 1024 * 1024
_STREAMED = ProcessingMode.STREAMED
# How long, from the latest body chunk, Envoy waits for the held headers' answer
# (bounded by the filter's max_message_timeout).
HOLD_TIMEOUT_S = 30

Responses = tuple[messages.ProcessingResponse, ...]
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
    def __init__(self, router: Router, end_at_decision: bool = False, shed: bool = False) -> None:
        self._router = router
        self._end_at_decision = end_at_decision
        # The router runs too far behind: decide on the headers and end the stream, so
        # Envoy sends no body and waits for no second answer.
        self._shed = shed
        self.phase = Phase.AWAITING_HEADERS
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._body_bytes = 0  # of a STREAMED body so far
        self._streamed = False
        self._max_body = router.config.max_body_bytes
        self.decision: Decision | None = None

    @property
    def ended(self) -> bool:
        """Nothing more is owed to Envoy: the service may close the stream now."""
        return self.phase is Phase.DECIDED and self._ends_at_decision

    @property
    def _ends_at_decision(self) -> bool:
        return self._end_at_decision or self._streamed

    def on_message(self, request: messages.ProcessingRequest) -> Responses:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(request)
        if kind == "request_body":
            return self._on_request_body(request)
        if kind is None:
            self._protocol_error("empty_message")
            return _NONE
        # Trailers and response phases: the default config skips them; pass through.
        return (messages.continue_for(kind),)

    def _on_request_headers(self, request: messages.ProcessingRequest) -> Responses:
        if self.phase is not Phase.AWAITING_HEADERS:
            self._protocol_error("duplicate_request_headers")
            return (messages.continue_for("request_headers"),)
        self._headers = messages.headers_of(request.request_headers)
        if _declared_length(self._headers) > self._max_body:
            return (self._refuse_too_large(),)
        if request.request_headers.end_of_stream:
            return (self._decide(b"", messages.route_on_headers),)
        if self._shed:
            shed = self._decide_shed()
            if shed is not None:
                return (shed,)
        config = request.protocol_config
        if (
            config.request_body_mode == _STREAMED
            and config.send_body_without_waiting_for_header_response
        ):
            self._streamed = True
            self.phase = Phase.HOLDING_HEADERS
            return _NONE
        self.phase = Phase.AWAITING_BODY
        return (messages.continue_for("request_headers"),)

    def _on_request_body(self, request: messages.ProcessingRequest) -> Responses:
        body = request.request_body
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

    def _decide(
        self,
        body: bytes,
        respond: Callable[[Decision, str | None], messages.ProcessingResponse],
    ) -> messages.ProcessingResponse:
        self.phase = Phase.DECIDED
        decision = self._routed(lambda: self._router.route(self._headers, body))
        assert decision is not None
        self.decision = decision
        if self._ends_at_decision:
            return respond(decision, self._router.hand_off(decision))
        return respond(decision, None)

    def _decide_shed(self) -> messages.ProcessingResponse | None:
        decision = self._routed(self._router.route_shed)
        if decision is None:
            return None
        self.phase = Phase.DECIDED
        self.decision = decision
        self._end_at_decision = True  # Envoy goes on without the router: no body comes
        return messages.route_on_headers(decision, self._router.hand_off(decision))

    def _refuse_too_large(self) -> messages.ProcessingResponse:
        """Over max_body_bytes: Envoy answers 413 and the stream is over, nothing routed."""
        metrics.REFUSED.labels("body_too_large").inc()
        self.phase = Phase.DECIDED
        self._end_at_decision = True
        return messages.refuse_too_large(self._max_body)

    def _routed(self, route: Callable[[], Decision | None]) -> Decision | None:
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
