"""Stacks of real processes: simulators, the router and the real Envoy binary."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import LocalStack, StackSpec

# Simulators answer max_tokens=1 at once and hold max_tokens=N for about N * 20 ms,
# which lets a test keep requests in flight on purpose.
SIM_ARGS = ("--ttft-ms", "0", "--itl-ms", "20")
THRESHOLD = 2


@pytest.fixture(scope="module", params=["override-host", "original-dst"])
def stack(request) -> Iterator[LocalStack]:
    spec = StackSpec.ephemeral(
        3,
        mode=request.param,
        sim_args=SIM_ARGS,
        router_settings={"concurrency_threshold": THRESHOLD, "prefix_length": 4096},
    )
    with LocalStack(spec) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        yield http


def fleet(stack: LocalStack) -> set[str]:
    return {f"{h}:{p}" for h, p in stack.spec.backends}
