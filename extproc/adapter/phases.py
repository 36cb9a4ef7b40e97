"""The per-stream ext_proc phase machine.

One instance per HTTP request. Envoy sends request headers, then (in BUFFERED_PARTIAL
mode) one request-body message holding the first bytes of the body. The router answers
the headers at once and puts its decision in the body response. A request with no body
(headers with end_of_stream) is decided on the headers. Every message gets an answer of
its own kind; one that arrives out of order is a counted protocol error, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import structlog

from extproc import metrics
from extproc.adapter import messages
from extproc.adapter.routing import Router
from extproc.errors import NoHostsError
from extproc.picker.decide import Decision

log = structlog.get_logger("ext_proc")


class Phase(Enum):
    # Nothing seen yet: the next message should be the request headers.
    AWAITING_HEADERS = "awaiting_headers"
    # Headers answered; the decision waits for the first body chunk.
    AWAITING_BODY = "awaiting_body"
    # Decision sent (or the request was refused); later messages are passed through.
    DECIDED = "decided"
    # The stream ended; in-flight accounting has been released.
    CLOSED = "closed"


class RequestStream:
    def __init__(self, router: Router) -> None:
        self._router = router
        self.phase = Phase.AWAITING_HEADERS
        self._headers: dict[str, str] = {}
        self.decision: Decision | None = None

    def on_message(self, request: messages.ProcessingRequest) -> messages.ProcessingResponse | None:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(request)
        if kind == "request_body":
            return self._on_request_body(request)
        if kind is None:
            self._protocol_error("empty_message")
            return None
        # Trailers and response phases: the default config skips them; pass through.
        return messages.continue_for(kind)

    def _on_request_headers(
        self, request: messages.ProcessingRequest
    ) -> messages.ProcessingResponse:
        if self.phase is not Phase.AWAITING_HEADERS:
            self._protocol_error("duplicate_request_headers")
            return messages.continue_for("request_headers")
        self._headers = messages.headers_of(request.request_headers)
        if request.request_headers.end_of_stream:
            return self._decide(b"", messages.route_on_headers)
        self.phase = Phase.AWAITING_BODY
        return messages.continue_for("request_headers")

    def _on_request_body(self, request: messages.ProcessingRequest) -> messages.ProcessingResponse:
        if self.phase is Phase.AWAITING_HEADERS:
            # Still route it, on the body alone.
            self._protocol_error("body_before_headers")
        elif self.phase is not Phase.AWAITING_BODY:
            self._protocol_error("body_after_decision")
            return messages.continue_for("request_body")
        return self._decide(request.request_body.body, messages.route_on_body)

    def _decide(
        self, body: bytes, respond: Callable[[Decision], messages.ProcessingResponse]
    ) -> messages.ProcessingResponse:
        self.phase = Phase.DECIDED
        try:
            self.decision = self._router.route(self._headers, body)
        except NoHostsError:
            metrics.FALLBACKS.labels("no_hosts").inc()
            log.warning("no_hosts")
            return messages.unavailable("prefix_router_no_hosts")
        return respond(self.decision)

    def _protocol_error(self, kind: str) -> None:
        metrics.PROTOCOL_ERRORS.labels(kind).inc()
        log.warning("protocol_error", kind=kind, phase=self.phase.value)

    def close(self) -> None:
        """Release the request's in-flight slot; safe to call more than once."""
        if self.phase is not Phase.CLOSED and self.decision is not None:
            self._router.finish(self.decision)
        self.phase = Phase.CLOSED
