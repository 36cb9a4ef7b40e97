"""Stacks of real processes: simulators, the router and the real Envoy binary."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import INSTANT_PREFILL, LocalStack, StackSpec

from ..reliability.stacks import NEVER_SHED

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


def variant_stack(variant: tuple[str, str], **overrides: object) -> Iterator[LocalStack]:
    """The stack of one (Envoy mode, body mode) variant, running until the generator ends."""
    mode, body_mode = variant
    spec = StackSpec.ephemeral(
        3,
        mode=mode,
        body_mode=body_mode,
        sim_args=SIM_ARGS,
        router_settings={"concurrency_threshold": THRESHOLD, "prefix_length": 4096}
        | INSTANT_PREFILL  # the simulators answer at once (--ttft-ms 0)
        | NEVER_SHED,
        # Placement by hash alone: a new prefix's place moves with the hosts' prompt-token
        # rates under cache pressure, so which hosts the earlier tests on this stack fed
        # would decide where the next test's new prefixes go: a clean-clone run beside a
        # busy core saw all 12 tenants of test_tenants_are_routed_independently on one
        # host. Pressure has its own tests (tests/control/test_pressure.py).
        control_plane_settings={"load_feed": {"pressure_factor": None}},
        **overrides,
    )
    with LocalStack(spec) as running:
        if body_mode == "streamed":
            # Envoy's workers open their access log streams to the router with their
            # first entries; until then the router counts a streamed request by the
            # load-feed estimate (tests/adapter/test_unseen.py), which holds a short
            # request for a scrape round. These tests are about the steady state.
            running.open_completion_logs()
        yield running


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def stack(request) -> Iterator[LocalStack]:
    yield from variant_stack(request.param)


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
