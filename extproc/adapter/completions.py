"""Requests whose ext_proc streams ended with their decisions, until Envoy logs them done.

A stream that ends at its decision no longer says when its request finishes. Envoy's
gRPC access log does: the router puts a ticket of its own in the decision's dynamic
metadata, Envoy logs that metadata when the request completes (or the client aborts), and
the log entry hands the ticket back. Tickets are the router's own, so a client cannot
forge one, and a router ignores the tickets of others. A ticket never logged (an entry
Envoy dropped) is given up after ``max_age_s``, so a lost entry cannot hold a slot forever.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict

# The key, in the decision's envoy.lb metadata, that carries the ticket.
TICKET_KEY = "prefix-router-ticket"


class Completions:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        # Distinguishes this router's tickets from every other router's.
        self._prefix = secrets.token_hex(6) + "-"
        self._sequence = itertools.count(1)
        # ticket -> (issued at, host), oldest first.
        self._open: OrderedDict[str, tuple[float, str]] = OrderedDict()
        # Access-log streams now open: tickets are issued only while one is.
        self.streams = 0

    @property
    def available(self) -> bool:
        return self.streams > 0

    def issue(self, host: str, now: float) -> str:
        ticket = f"{self._prefix}{next(self._sequence)}"
        self._open[ticket] = (now, host)
        return ticket

    def complete(self, ticket: str) -> str | None:
        """The host of a ticket this router issued and still holds, or None."""
        entry = self._open.pop(ticket, None)
        return None if entry is None else entry[1]

    def expire(self, now: float) -> list[str]:
        """Give up tickets older than ``max_age_s``; returns their hosts."""
        hosts = []
        oldest = now - self.max_age_s
        while self._open:
            ticket, (issued, host) = next(iter(self._open.items()))
            if issued >= oldest:
                break
            del self._open[ticket]
            hosts.append(host)
        return hosts

    def __len__(self) -> int:
        return len(self._open)
