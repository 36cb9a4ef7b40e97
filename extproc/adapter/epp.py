"""The Gateway API Inference Extension's endpoint-picker protocol (1.0.0), read side.

What a gateway tells an endpoint picker (EPP) beyond the request itself, parsed from an
ext_proc message's ``metadata_context``:

- the subset hint: the only endpoints the request may go to (kgateway sends every pool
  endpoint; Istio sends none, and then the whole pool is eligible);
- the served endpoint, at response time: where the request really went, which may differ
  from the pick when the gateway retried or fell back.

And the conformance suite's test hook, honoured only when ``epp_conformance_hooks`` is on
(a client must never choose the upstream otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import struct_pb2

from extproc.adapter.messages import ProcessingRequest
from extproc.picker.hosts import Host, HostSet, parse_host_address

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# The conformance suite's request header naming the endpoints a request must land on.
SELECTION_HEADER = "test-epp-endpoint-selection"
# What the hooks set: the request header that asks the conformance suite's echo server
# to set a response header, and that response header, naming the endpoint.
ECHO_SET_HEADER = "x-echo-set-header"
SERVED_RESPONSE_HEADER = "x-conformance-test-served-endpoint"
# A hint longer than this is cut: a pool has at most a few thousand endpoints.
MAX_HINT_ENDPOINTS = 4096


def _strings(value: struct_pb2.Value) -> list[str]:
    """A list of strings, or one comma-separated string (lwepp accepts both)."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    if kind == "string_value":
        return value.string_value.split(",")
    return []


def _endpoints(texts: Iterable[str]) -> tuple[str, ...]:
    """The valid ``ip:port`` entries, normalised, in order, without duplicates."""
    found: dict[str, None] = {}
    for count, text in enumerate(texts):
        if count >= MAX_HINT_ENDPOINTS:
            break
        try:
            found[parse_host_address(text)] = None
        except ValueError:
            continue
    return tuple(found)


def subset_hint(request: ProcessingRequest) -> tuple[str, ...] | None:
    """The hint's endpoints (valid ones only), or None when the gateway sent no hint."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    return _endpoints(_strings(fields[SUBSET_KEY]))


def served_endpoint(request: ProcessingRequest) -> str | None:
    """The endpoint the gateway reports as having served the request, if valid."""
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE not in namespaces:
        return None
    fields = namespaces[LB_NAMESPACE].fields
    if SERVED_KEY not in fields:
        return None
    found = _endpoints(_strings(fields[SERVED_KEY]))
    return found[0] if found else None


def eligible(published: HostSet, allowed: tuple[str, ...]) -> HostSet:
    """The hosts a request may go to, given the gateway's (or the test hook's) list.

    With a published host set (control plane or static hosts), only published hosts are
    eligible: the router never emits a target outside it. Without one, the gateway's list
    is the pool.
    """
    if not published.hosts:
        return HostSet.of(allowed)
    wanted = set(allowed)
    return HostSet.of_hosts(h for h in published.hosts if h.address in wanted)


def selection(value: str, published: HostSet) -> tuple[str, ...]:
    """The conformance hook's endpoints: comma-separated ``ip:port`` tokens, or bare IPs,
    which name every published port of that IP (one pod, data-parallel ranks)."""
    chosen: dict[str, None] = {}
    for token in (t.strip() for t in value.split(",")):
        if not token:
            continue
        try:
            chosen[parse_host_address(token)] = None
            continue
        except ValueError:
            pass
        for host in published.hosts:
            if _ip_of(host) == token.removeprefix("[").removesuffix("]"):
                chosen[host.address] = None
    return tuple(chosen)


def _ip_of(host: Host) -> str:
    return host.address.rpartition(":")[0].removeprefix("[").removesuffix("]")
