"""Buffered bodies with ``stream_end: decision`` behind an Envoy that logs completions to
the router (``envoy-config --completion-log``, what ``up --stream-end decision``
generates): Envoy holds no ext_proc stream through a streaming response, and the router
still counts each request in flight until its response ends, released by the log."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.stack.local import INSTANT_PREFILL, LocalStack, StackSpec

from .conftest import SIM_ARGS, THRESHOLD

# The same checks as the streamed variants', on this stack (pytest collects them here too,
# with this module's ``stack``).
from .test_routing_through_envoy import (
    test_every_envoy_worker_logs_its_completions_to_the_router,
    test_ext_proc_streams_follow_decisions_not_responses,
)

__all__ = [
    "test_every_envoy_worker_logs_its_completions_to_the_router",
    "test_ext_proc_streams_follow_decisions_not_responses",
]


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    routing = {"concurrency_threshold": THRESHOLD, "prefix_length": 4096, "stream_end": "decision"}
    spec = StackSpec.ephemeral(
        3,
        body_mode="buffered-partial",
        sim_args=SIM_ARGS,
        router_settings=routing | INSTANT_PREFILL,
        envoy_settings={"completion_log": True},
    )
    with LocalStack(spec) as running:
        # Each Envoy worker opens its log stream with its first entry (see conftest.py).
        running.open_completion_logs()
        yield running
