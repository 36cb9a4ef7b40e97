"""``prefix-router epp`` through the real Envoy, configured as Istio, kgateway and the
Inference Extension's reference Envoy configure it (``extproc/stack/gateways.py``).

Each covers prefix affinity, bodies delivered byte for byte, streamed responses, the
served endpoint, the conformance suite's routing tests (through the picker's test hook)
and the picker killed. kgateway alone forwards a subset hint."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from grpc_health.v1 import health_pb2

from extproc.adapter import epp
from extproc.adapter.service import SERVICE_NAME
from extproc.bench.bodies import body_of_size
from extproc.stack.envoy_admin import envoy_workers, healthy_hosts
from extproc.stack.epp_gateway import EppGateway
from extproc.stack.gateways import EPP_CLUSTER
from extproc.stack.processes import wait_until

pytestmark = pytest.mark.envoy

KiB, MiB = 1024, 1024 * 1024
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module", params=["istio", "kgateway", "standalone"])
def gateway(request) -> Iterator[EppGateway]:
    # kgateway sends every pool endpoint as the subset hint: its picker is given none.
    stack = EppGateway(request.param, picker_hosts=request.param != "kgateway")
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture
def client(gateway: EppGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield http


def chat(text: str, max_tokens: int = 1, stream: bool = False) -> bytes:
    body = {
        "model": "sim-model",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }
    return json.dumps(body).encode()


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text[:300]
    return response.headers["x-upstream-host"]


def test_the_health_port_answers_every_service_the_charts_probe(gateway: EppGateway):
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "liveness", "readiness", "inference-extension", SERVICE_NAME):
        assert gateway.health(service) == serving, service


def test_a_prompt_returns_to_the_endpoint_that_holds_it(gateway: EppGateway, client):
    homes: dict[int, set[str]] = {}
    for round_ in range(3):
        for doc in range(8):
            text = f"document {doc} " + "shared context of this document " * 300
            response = client.post("/v1/chat/completions", content=chat(text), headers=JSON)
            homes.setdefault(doc, set()).add(served_by(response))
        assert round_ < 3
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) >= 2  # the documents spread over the pool
    assert set().union(*homes.values()) <= gateway.endpoints


def _upload(body: bytes, upload: str) -> Iterator[bytes]:
    if upload == "chunked":
        yield from (body[i : i + 64 * KiB] for i in range(0, len(body), 64 * KiB))
        return
    step = max(1, -(-len(body) // 16))
    for i in range(0, len(body), step):
        time.sleep(0.02)  # the slow drip is the scenario
        yield body[i : i + step]


@pytest.mark.parametrize("upload", ["chunked", "slow-drip"])
@pytest.mark.parametrize(
    "size", [0, KiB, 64 * KiB, MiB, 8 * MiB], ids=["0B", "1KB", "64KB", "1MiB", "8MiB"]
)
def test_bodies_reach_the_endpoint_byte_for_byte(gateway: EppGateway, client, size, upload):
    body = body_of_size(size)
    response = client.post("/v1/chat/completions", content=_upload(body, upload), headers=JSON)
    assert response.headers["x-upstream-host"] in gateway.endpoints
    assert response.headers["x-request-body-bytes"] == str(size)
    assert response.headers["x-request-body-sha256"] == hashlib.sha256(body).hexdigest()


def _stream_text(raw: bytes) -> tuple[str, list[str]]:
    """The streamed reply's text, and its SSE events' payloads."""
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    text = ""
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            text += choice.get("delta", {}).get("content") or ""
    return text, events


def test_streamed_responses_come_back_intact(gateway: EppGateway, client):
    body = chat("tell me a story " * 50, max_tokens=40, stream=True)
    with client.stream("POST", "/v1/chat/completions", content=body, headers=JSON) as response:
        raw = b"".join(response.iter_raw())
        endpoint = served_by(response)
    text, events = _stream_text(raw)
    assert events[-1] == "[DONE]"
    # The same request straight to the endpoint that served it: the same reply.
    direct = httpx.post(f"http://{endpoint}/v1/chat/completions", content=body, headers=JSON)
    direct_text, direct_events = _stream_text(direct.content)
    assert (text, len(events)) == (direct_text, len(direct_events))
    assert len(events) > 40


def test_requests_land_only_on_the_endpoints_the_test_header_names(gateway: EppGateway, client):
    """The conformance suite's GatewayFollowingEPPRouting and its data-parallel variant:
    bare IPs name every port of a pod, ip:port one rank."""
    pool = sorted(gateway.endpoints)
    ips = sorted({e.rpartition(":")[0] for e in pool})
    rank = pool[-1] if pool[-1].startswith("127.0.0.13") else pool[-2]
    cases = [
        (ips[0], {e for e in pool if e.startswith(ips[0] + ":")}),
        (",".join(ips[:2]), {e for e in pool if e.rpartition(":")[0] in ips[:2]}),
        (",".join(ips), set(pool)),
        ("127.0.0.13", {e for e in pool if e.startswith("127.0.0.13:")}),
        (rank, {rank}),
    ]
    for value, allowed in cases:
        seen = set()
        for number in range(10):
            headers = {**JSON, epp.SELECTION_HEADER: value}
            response = client.post(
                "/v1/chat/completions", content=chat(f"conformance {number}"), headers=headers
            )
            seen.add(served_by(response))
        assert seen <= allowed, (value, seen)


def test_a_selection_with_no_eligible_endpoint_is_answered_503(gateway: EppGateway, client):
    before = gateway.metric("prefix_router_refused_total", reason="no_eligible_endpoint")
    headers = {**JSON, epp.SELECTION_HEADER: "127.0.0.99"}
    response = client.post("/v1/chat/completions", content=chat("x"), headers=headers)
    assert response.status_code == 503
    after = gateway.metric("prefix_router_refused_total", reason="no_eligible_endpoint")
    assert after == before + 1


def test_a_client_cannot_choose_the_endpoint(gateway: EppGateway, client):
    """The test hook is the picker's; a client's own destination header is stripped."""
    pool = sorted(gateway.endpoints)
    seen = set()
    for number in range(12):
        headers = {**JSON, "x-gateway-destination-endpoint": pool[0]}
        text = f"client {number} " * 100
        seen.add(
            served_by(client.post("/v1/chat/completions", content=chat(text), headers=headers))
        )
    assert seen != {pool[0]}


def test_the_served_endpoint_is_recorded_where_the_gateway_reports_it(gateway: EppGateway, client):
    """GatewayDestinationEndpointServed. Istio's override_host policy reports the endpoint it
    used; the picker echoes it (test hook) and counts the request there. kgateway and the
    reference Envoy report none, so the picker keeps its own pick."""
    endpoint = sorted(gateway.endpoints)[1]
    headers = {**JSON, epp.SELECTION_HEADER: endpoint}
    response = client.post("/v1/chat/completions", content=chat("served"), headers=headers)
    assert served_by(response) == endpoint
    echoed = response.headers.get(epp.SERVED_RESPONSE_HEADER)
    if gateway.params.gateway == "istio":
        assert echoed == endpoint
    else:
        assert echoed is None
    assert gateway.metric("prefix_router_served_elsewhere_total") == 0


@pytest.mark.parametrize("gateway", ["kgateway"], indirect=True)
def test_kgateways_subset_hint_limits_the_pick_and_an_ineligible_one_gets_503(
    gateway: EppGateway,
):
    """The picker knows no pool here: the hint is the pool. Envoys like this one but with
    a narrower, an empty and an unknown-only hint."""
    pool = sorted(gateway.endpoints)
    narrow, _ = gateway.with_hint((pool[0], pool[2]))
    empty, _ = gateway.with_hint(())
    junk, _ = gateway.with_hint(("not-an-endpoint", "127.0.0.1"))
    with httpx.Client(timeout=30) as http:
        seen = set()
        for number in range(12):
            text = f"hinted {number} " + "context " * 200
            response = http.post(f"{narrow}/v1/chat/completions", content=chat(text), headers=JSON)
            seen.add(served_by(response))
        assert seen == {pool[0], pool[2]}
        before = gateway.metric("prefix_router_refused_total", reason="no_eligible_endpoint")
        for url in (empty, junk):
            response = http.post(f"{url}/v1/chat/completions", content=chat("x"), headers=JSON)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == 503
        after = gateway.metric("prefix_router_refused_total", reason="no_eligible_endpoint")
        assert after == before + 2


def test_the_picker_killed_fails_open_where_the_pool_says_so(gateway: EppGateway, client):
    """EppUnAvailableFailOpen. The first requests to find the picker gone may get Envoy's
    500: the body had started to flow into a stream that then failed (FULL_DUPLEX_STREAMED
    cannot fail open then). The refused connection ejects the picker; the ejection is
    decided on Envoy's main thread and reaches each worker thread a moment later, so up to
    one request per worker may fail this way (CI saw two on 2 workers). Every later request
    fails open at its start. The reference Envoy's ORIGINAL_DST cluster has nowhere to send
    a request the picker did not place, so it fails closed, at once."""
    gateway.stop_picker()
    try:
        statuses = []
        for number in range(12):
            started = time.monotonic()
            response = client.post(
                "/v1/chat/completions", content=chat(f"no picker {number}"), headers=JSON
            )
            statuses.append(response.status_code)
            assert time.monotonic() - started < 5
            if response.status_code == 200:
                assert response.headers["x-upstream-host"] in gateway.endpoints
        if gateway.params.gateway == "standalone":
            assert set(statuses) == {500}, statuses
        else:
            failed = statuses.index(200) if 200 in statuses else len(statuses)
            assert failed <= envoy_workers(gateway.admin_url), statuses
            assert set(statuses[:failed]) <= {500} and set(statuses[failed:]) == {200}, statuses
    finally:
        gateway.start_picker()
    # The ejection ends: the first refused connection ejected the picker (outlier
    # detection), and Envoy readmits it once the ejection time (2 s) has passed.
    wait_until(lambda: picker_healthy(gateway), 10, what="Envoy to readmit the picker")
    response = client.post("/v1/chat/completions", content=chat("back"), headers=JSON)
    assert response.status_code == 200


def picker_healthy(gateway: EppGateway) -> bool:
    """Whether Envoy's picker cluster holds a host it may send to, from its admin page."""
    return bool(healthy_hosts(gateway.admin_url, EPP_CLUSTER))
