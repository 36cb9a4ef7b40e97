"""Every body shape is routed and reaches the upstream byte for byte."""

from __future__ import annotations

import gzip
import hashlib
import time
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.bootstrap import BootstrapParams
from extproc.stack.local import LocalStack, envoy_counters

from .conftest import VARIANTS, fleet, variant_stack


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def stack(request) -> Iterator[LocalStack]:
    # Without KV events: these bodies (up to 8 MiB of prompt) are far past any model's
    # context, which vLLM refuses, while the simulator takes them and would publish each
    # character as a token: the router would ingest hundreds of thousands of engine blocks
    # per request, on the 2 cores Envoy streams the bodies on. Body delivery is what is
    # tested here; tests/integration/test_kv_events.py tests the events.
    yield from variant_stack(request.param, sim_kv_events=False)


# Bodies up to the router's max_body_bytes and past it: tests/bench/test_bodies.py and
# `prefix-router bench bodies`.
LARGE = 8 * 1024 * 1024 - 4096


def chat_of_size(size: int, tag: str = "") -> bytes:
    """A valid chat body of exactly ``size`` bytes, its text starting with ``tag`` (so that
    bodies of different tests do not share one hot prefix)."""
    head = b'{"model":"sim-model","max_tokens":1,"messages":[{"role":"user","content":"'
    tail = b'"}]}'
    text = (tag or str(size)).encode()
    return head + text + b"a" * (size - len(head) - len(tail) - len(text)) + tail


def assert_delivered(stack: LocalStack, response: httpx.Response, body: bytes) -> None:
    assert response.headers["x-served-by"] in fleet(stack)
    assert response.headers["x-upstream-host"] == response.headers["x-served-by"]
    assert int(response.headers["x-request-body-bytes"]) == len(body)
    assert response.headers["x-request-body-sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize(
    "size",
    [1024, 64 * 1024, 1024 * 1024 + 4096, 2 * 1024 * 1024, LARGE],
    ids=["1KB", "64KB", "just-over-1MiB", "2MB", "8MiB"],
)
def test_sized_bodies_are_routed_and_delivered_whole(stack: LocalStack, client, size):
    body = chat_of_size(size)
    first = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    second = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert first.status_code == second.status_code == 200
    assert_delivered(stack, first, body)
    assert first.headers["x-served-by"] == second.headers["x-served-by"]


def test_bodies_far_over_the_kept_limit_arrive_whole_every_time(stack: LocalStack, client):
    """With STREAMED bodies the router reads to the end before it closes the stream:
    closing while the body was still arriving made Envoy 1.40 send chunks twice (6 of 40
    bodies of 8 MiB). BUFFERED_PARTIAL must deliver them whole too."""
    body = chat_of_size(LARGE, tag="far-over")
    digest = hashlib.sha256(body).hexdigest()
    for _ in range(10):
        response = client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text[:200]
        assert int(response.headers["x-request-body-bytes"]) == len(body)
        assert response.headers["x-request-body-sha256"] == digest


def test_empty_body_is_routed(stack: LocalStack, client):
    response = client.post("/v1/chat/completions", content=b"")
    assert response.status_code == 400  # the upstream's verdict, not the router's
    assert_delivered(stack, response, b"")


def test_chunked_body_is_routed_and_delivered(stack: LocalStack, client):
    body = chat_of_size(300_000)
    chunks = [body[i : i + 8192] for i in range(0, len(body), 8192)]
    response = client.post("/v1/chat/completions", content=iter(chunks))
    assert response.status_code == 200
    assert_delivered(stack, response, body)


def test_slow_drip_body_is_routed_and_delivered(stack: LocalStack, client):
    body = chat_of_size(20_000)

    def drip():
        for i in range(0, len(body), 2000):
            time.sleep(0.05)  # the slow drip is the scenario
            yield body[i : i + 2000]

    response = client.post("/v1/chat/completions", content=drip())
    assert response.status_code == 200
    assert_delivered(stack, response, body)


def test_a_body_that_stalls_past_message_timeout_is_routed_and_delivered(stack, client):
    """A client that pauses longer than Envoy's message_timeout mid-body. With STREAMED
    bodies the timer runs while the router holds the headers' answer, so the router
    extends it on each chunk; without that, this was a 504 (original-dst) or a damaged
    body upstream (override-host, failing open)."""
    body = chat_of_size(20_000, tag="stalls")
    pause_s = 2 * BootstrapParams.message_timeout_ms / 1000

    def stalling():
        yield body[:5000]
        time.sleep(pause_s)  # the stall past message_timeout is the scenario
        yield body[5000:]

    response = client.post("/v1/chat/completions", content=stalling())
    assert response.status_code == 200, response.text[:200]
    assert_delivered(stack, response, body)
    stats = envoy_counters(stack.admin_url, "http.ingress.ext_proc.")
    assert stats["message_timeouts"] == 0, stats


BAD_BODIES = {
    "non-json": (b"this is not json at all " * 100, {}),
    "truncated-json": (chat_of_size(5000, "truncated")[:3000], {}),
    "invalid-utf8": (b'{"messages":[{"role":"user","content":"\xff\xfe\xfd"}]}', {}),
    "gzip": (gzip.compress(chat_of_size(5000)), {"content-encoding": "gzip"}),
    "deeply-nested": (b'{"messages":' + b"[" * 50_000 + b"]" * 50_000 + b"}", {}),
    "nul-bytes": (b"\x00" * 4096, {}),
    "wrong-content-type": (chat_of_size(2000), {"content-type": "image/png"}),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_input_is_routed_and_the_router_survives(stack: LocalStack, client, name):
    body, headers = BAD_BODIES[name]
    response = client.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code in (200, 400)  # whatever the upstream made of it
    assert_delivered(stack, response, body)
    # The same bad body is routed the same way.
    again = client.post("/v1/chat/completions", content=body, headers=headers)
    assert again.headers["x-served-by"] == response.headers["x-served-by"]
    assert stack.router is not None and stack.router.running
    metrics = httpx.get(stack.router_metrics_url).text
    assert (
        "prefix_router_protocol_errors_total" not in metrics
        or 'kind="internal_error"' not in metrics
    )
