"""State-of-the-world xDS protocol for one stream, with no gRPC in it.

The stream handler owns nonces, ACKs and NACKs; the store owns the data. Rules:
- every response carries a fresh nonce from a per-stream counter;
- a request whose nonce is not the latest one sent is stale and ignored;
- an ACK (latest nonce, no error) is recorded and never answered, or the two sides loop;
- a NACK is logged and counted with its error_detail, and the rejected versions are not
  sent again: only a newer version of a resource goes out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse

__all__ = ["DiscoveryRequest", "DiscoveryResponse", "XdsStream"]

from extproc.control import metrics
from extproc.control.resources import CLA_TYPE_URL, to_any
from extproc.control.snapshot import SnapshotStore, content_version

log = structlog.get_logger("xds")

# Rejected versions remembered per resource and stream. Versions are content hashes, so an
# old content can come back; one rejected longer ago than this is offered again.
MAX_REJECTED_VERSIONS = 32


@dataclass
class StreamState:
    node: str = ""
    subscribed: frozenset[str] = frozenset()
    # Per resource: the version last sent on this stream (ACKed or not).
    sent: dict[str, str] = field(default_factory=dict)
    # Per resource: versions the client rejected, never resent; the latest
    # MAX_REJECTED_VERSIONS of them (insertion-ordered), so a client that rejects every
    # version costs a bounded amount of memory.
    rejected: dict[str, dict[str, None]] = field(default_factory=dict)
    nonce_counter: int = 0
    last_nonce: str = ""
    last_version: str = ""
    # Resource versions carried by the response with ``last_nonce``: what a NACK rejects.
    last_sent: dict[str, str] = field(default_factory=dict)
    acked_version: str = ""
    # A response is out that the client has not answered (ACK or NACK) yet. Nothing more
    # is sent until it is: a slow or stuck client holds one response, not every change
    # (gRPC buffers whatever a stream is given), and its next one carries the latest.
    awaiting_answer: bool = False


class XdsStream:
    """Turns requests and store changes into responses for one client stream."""

    def __init__(self, store: SnapshotStore, default_resources: frozenset[str]) -> None:
        self._store = store
        # Plain EDS with no names (a wildcard) gets the fleet clusters.
        self._default_resources = default_resources
        self.state = StreamState()

    def on_request(self, request: DiscoveryRequest) -> DiscoveryResponse | None:
        state = self.state
        if request.node.id:
            state.node = request.node.id
        if request.type_url and request.type_url != CLA_TYPE_URL:
            metrics.XDS_REQUESTS.labels("unsupported_type").inc()
            log.warning("xds_unsupported_type", type_url=request.type_url, node=state.node)
            return None
        if request.response_nonce and request.response_nonce != state.last_nonce:
            metrics.XDS_REQUESTS.labels("stale_nonce").inc()
            return None

        names = frozenset(request.resource_names) or self._default_resources
        state.awaiting_answer = False  # answered, or asked afresh
        if request.response_nonce and request.HasField("error_detail"):
            self._on_nack(request)
        elif request.response_nonce:
            metrics.XDS_REQUESTS.labels("ack").inc()
            state.acked_version = request.version_info
        else:
            metrics.XDS_REQUESTS.labels("initial").inc()

        if names != state.subscribed:
            # A new subscription (or a reconnect): resources the client now wants must be
            # sent even if their versions were sent before on this stream.
            for name in names - state.subscribed:
                state.sent.pop(name, None)
            state.subscribed = names
        return self.pending()

    def _on_nack(self, request: DiscoveryRequest) -> None:
        state = self.state
        metrics.XDS_NACKS.inc()
        for name, version in state.last_sent.items():
            versions = state.rejected.setdefault(name, {})
            versions.pop(version, None)
            versions[version] = None
            while len(versions) > MAX_REJECTED_VERSIONS:
                del versions[next(iter(versions))]
        log.error(
            "xds_nack",
            node=state.node,
            nonce=request.response_nonce,
            kept_version=request.version_info,
            rejected_version=state.last_version,
            error=request.error_detail.message,
        )

    def pending(self) -> DiscoveryResponse | None:
        """A response with every subscribed resource whose version is new to this stream."""
        state = self.state
        if state.awaiting_answer:
            return None
        changed = []
        for name in sorted(state.subscribed):
            snapshot = self._store.get(name)
            if snapshot is None or snapshot.version == state.sent.get(name):
                continue
            if snapshot.version in state.rejected.get(name, ()):
                continue
            changed.append(snapshot)
        if not changed:
            return None
        for snapshot in changed:
            state.sent[snapshot.name] = snapshot.version
        state.last_sent = {snapshot.name: snapshot.version for snapshot in changed}
        state.nonce_counter += 1
        state.last_nonce = str(state.nonce_counter)
        state.awaiting_answer = True
        # Sent resources only: in state-of-the-world EDS, a cluster left out is unchanged.
        state.last_version = content_version(sorted(state.sent.items()))
        response = DiscoveryResponse(
            version_info=state.last_version, type_url=CLA_TYPE_URL, nonce=state.last_nonce
        )
        response.resources.extend(to_any(s) for s in changed)
        metrics.XDS_RESPONSES.inc()
        return response
