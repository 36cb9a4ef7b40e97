"""Stacks of real processes: simulators, the router and the real Envoy binary."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import LocalStack, StackSpec
from extproc.stack.processes import wait_until

# Simulators answer max_tokens=1 at once and hold max_tokens=N for about N * 20 ms,
# which lets a test keep requests in flight on purpose.
SIM_ARGS = ("--ttft-ms", "0", "--itl-ms", "20")
THRESHOLD = 2


# (Envoy mode, body mode): both in both. STREAMED bodies take one round trip, and their
# streams end with the decision; Envoy's access log then reports each completion.
VARIANTS = [
    ("override-host", "buffered-partial"),
    ("original-dst", "buffered-partial"),
    ("override-host", "streamed"),
    ("original-dst", "streamed"),
]


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def stack(request) -> Iterator[LocalStack]:
    mode, body_mode = request.param
    spec = StackSpec.ephemeral(
        3,
        mode=mode,
        body_mode=body_mode,
        sim_args=SIM_ARGS,
        router_settings={"concurrency_threshold": THRESHOLD, "prefix_length": 4096},
    )
    with LocalStack(spec) as running:
        if body_mode == "streamed":
            open_completion_log(running)
        yield running


def open_completion_log(stack: LocalStack) -> None:
    """Envoy opens its access log stream to the router with its first entry; until then
    the router counts a streamed request by the load-feed estimate, which holds a short
    request for up to a scrape round (tests/adapter/test_unseen.py). These tests are about
    the steady state: one request first, then wait for the log and an empty estimate."""
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "w"}]}
    httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).raise_for_status()
    wait_until(
        lambda: (
            (stack.router_metric("prefix_router_access_log_streams") or 0) >= 1
            and stack.router_metric("prefix_router_unseen_decisions") == 0
        ),
        15,
        "Envoy's access log stream to the router",
    )


def streams_end_at_decision(stack: LocalStack) -> bool:
    """STREAMED bodies end the stream with the decision, whatever stream_end says."""
    return (
        stack.spec.body_mode == "streamed"
        or stack.spec.router_settings.get("stream_end") == "decision"
    )


@pytest.fixture
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        yield http


def fleet(stack: LocalStack) -> set[str]:
    return {f"{h}:{p}" for h, p in stack.spec.backends}
