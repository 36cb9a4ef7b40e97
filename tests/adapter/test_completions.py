"""Completions: tickets issued at hand-off, returned by Envoy's access log."""

from __future__ import annotations

import random

from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage

from extproc.adapter.access_log import tickets_of
from extproc.adapter.completions import TICKET_KEY, Completions
from extproc.adapter.ledger import COMPLETION_MAX_AGE_S
from extproc.adapter.messages import LB_METADATA_NAMESPACE
from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.picker.decide import Strategy

A = "127.0.0.11:8000"
B = "127.0.0.12:8000"


def test_a_ticket_completes_once_and_only_for_its_issuer() -> None:
    mine, theirs = Completions(max_age_s=60), Completions(max_age_s=60)
    ticket = mine.issue(A, now=1.0)
    assert theirs.complete(ticket) is None  # another router's ticket
    assert mine.complete(ticket) == A
    assert mine.complete(ticket) is None  # a duplicate log entry
    assert len(mine) == 0


def test_tickets_never_logged_expire_oldest_first() -> None:
    completions = Completions(max_age_s=10)
    completions.issue(A, now=0.0)
    completions.issue(B, now=5.0)
    kept = completions.issue(A, now=9.0)
    assert completions.expire(now=12.0) == [A]
    assert completions.expire(now=16.0) == [B]
    assert completions.complete(kept) == A


def log_batch(*tickets: str | None) -> StreamAccessLogsMessage:
    message = StreamAccessLogsMessage()
    for ticket in tickets:
        entry = message.http_logs.log_entry.add()
        if ticket is not None:
            metadata = entry.common_properties.metadata.filter_metadata[LB_METADATA_NAMESPACE]
            metadata.fields[TICKET_KEY].string_value = ticket
    return message


def test_tickets_are_read_from_the_entries_envoy_lb_metadata() -> None:
    assert tickets_of(log_batch("r-1", None, "r-2")) == ["r-1", "", "r-2"]
    assert tickets_of(StreamAccessLogsMessage()) == []


def test_a_handed_off_request_stays_in_flight_until_its_completion_is_logged() -> None:
    clock = [100.0]
    router = Router(
        RouterConfig(hosts=(A, B), routing_strategy=Strategy.RANDOM),
        random.Random(1),
        clock=lambda: clock[0],
    )
    router.ledger.completions.streams = 1  # an access-log stream is open
    decision = router.route({}, b"{}")
    ticket = router.hand_off(decision)
    assert ticket is not None
    assert router.ledger.in_flight.snapshot() == {decision.primary: 1}
    assert router.ledger.unseen.total() == 0
    assert not router.ledger.complete("someone-else-1")
    assert router.ledger.complete(ticket)
    assert router.ledger.in_flight.total() == 0
    # One never logged is released at the next hand-off after COMPLETION_MAX_AGE_S.
    lost = router.hand_off(router.route({}, b"{}"))
    assert lost is not None
    clock[0] += COMPLETION_MAX_AGE_S + 1
    later = router.route({}, b"{}")
    router.hand_off(later)
    assert router.ledger.in_flight.snapshot() == {later.primary: 1}


def test_without_an_access_log_stream_hand_off_falls_back_to_the_estimate() -> None:
    router = Router(RouterConfig(hosts=(A, B)), random.Random(1))
    decision = router.route({}, b"{}")
    assert router.hand_off(decision) is None
    assert router.ledger.in_flight.total() == 0
    assert router.ledger.unseen.total() == 1
