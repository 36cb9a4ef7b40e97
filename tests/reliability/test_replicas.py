"""Two router replicas behind one Envoy: they agree, and one can stop gracefully."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from extproc.adapter.messages import (
    LB_METADATA_KEY,
    LB_METADATA_NAMESPACE,
    ProcessingResponse,
)
from extproc.adapter.service import SERVICE_NAME
from extproc.stack import prometheus
from extproc.stack.local import LocalStack
from extproc.stack.processes import wait_until

from ..extproc_messages import request_body, request_headers
from ..prompts import document
from .stacks import placements, reliability_spec
from .steady import CHAT, SteadyTraffic, chat

pytestmark = pytest.mark.envoy

DOCS = range(30)


def decisions(stack: LocalStack, replica: int) -> float:
    samples = prometheus.scrape(stack.replica_metrics_url(replica))
    return prometheus.total(samples, "prefix_router_decisions_total")


def ask_replica(stack: LocalStack, replica: int, body: bytes) -> list[str]:
    """One ext_proc stream straight to a replica: its target list for ``body``."""
    host, port = stack.router_addresses[replica][0]
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        process = channel.stream_stream(
            f"/{SERVICE_NAME}/Process",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        messages = [
            request_headers({":method": "POST", "content-type": "application/json"}),
            request_body(body),
        ]
        call = process(iter(messages), timeout=10)
        responses = [next(call), next(call)]
        # Reset, as Envoy does: the router would send its status only RESET_WAIT_S later.
        call.cancel()
    answer = ProcessingResponse.FromString(responses[1])
    value = answer.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    return value.fields[LB_METADATA_KEY].string_value.split(",")


def test_two_replicas_make_the_same_choice_for_the_same_key():
    with LocalStack(reliability_spec(5, router_replicas=2)) as stack:
        bodies = [json.dumps(chat(document(d) + f" q{d}")).encode() for d in DOCS]
        first = [ask_replica(stack, 0, body) for body in bodies]
        second = [ask_replica(stack, 1, body) for body in bodies]
        assert first == second  # the whole failover list, not just the primary
        assert len({targets[0] for targets in first}) >= 4
        # Through Envoy, requests spread over both replicas and still land consistently.
        base = (decisions(stack, 0), decisions(stack, 1))
        rounds = [placements(stack, DOCS) for _ in range(3)]
        assert rounds[0] == rounds[1] == rounds[2]
        assert decisions(stack, 0) > base[0] and decisions(stack, 1) > base[1]


@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_router_workers_are_endpoints_that_share_the_streams_and_agree(mode):
    # ``router --workers 2``: one process, two workers, each its own endpoint.
    with LocalStack(reliability_spec(5, mode=mode, router_workers=2)) as stack:
        assert [p for p in stack.routers if p is not None] == [stack.router]
        endpoints = {f"{host}:{port}" for (host, port), _ in stack.router_addresses}
        assert len(endpoints) == 2 and stack.healthy_routers() == endpoints
        bodies = [json.dumps(chat(document(d) + f" q{d}")).encode() for d in DOCS]
        first = [ask_replica(stack, 0, body) for body in bodies]
        assert [ask_replica(stack, 1, body) for body in bodies] == first
        base = (decisions(stack, 0), decisions(stack, 1))
        rounds = [placements(stack, DOCS) for _ in range(3)]
        assert rounds[0] == rounds[1] == rounds[2]
        assert {rounds[0][d] for d in DOCS} == {t[0] for t in first}
        assert decisions(stack, 0) > base[0] and decisions(stack, 1) > base[1]


def stream_to_the_end(url: str, doc: int, results: list[tuple[int, str | None, str]]) -> None:
    body = chat(document(doc), max_tokens=100, stream=True)  # ~2 s of tokens
    try:
        with (
            httpx.Client(base_url=url, timeout=30) as client,
            client.stream("POST", CHAT, json=body) as response,
        ):
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            last = lines[-1] if lines else "(no events)"
            results.append((response.status_code, response.headers.get("x-served-by"), last))
    except httpx.HTTPError as error:
        results.append((0, None, repr(error)))


@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_sigterm_on_one_replica_cuts_nothing_and_envoy_moves_to_the_other(mode: str):
    spec = reliability_spec(3, router_replicas=2, mode=mode)
    with LocalStack(spec) as stack:
        home = placements(stack, DOCS)
        fleet = set(stack.backend_addresses)
        streams: list[tuple[int, str | None, str]] = []
        with SteadyTraffic(stack.url, docs=len(DOCS)).running() as traffic:
            traffic.wait_for(50)
            threads = [
                threading.Thread(target=stream_to_the_end, args=(stack.url, d, streams))
                for d in range(12)
            ]
            for thread in threads:
                thread.start()
            # Both replicas hold long streams (Envoy balances by least requests).
            wait_until(
                lambda: (stack.router_metric("prefix_router_open_streams", 0) or 0) >= 2,
                10,
                "long streams on replica 0",
            )
            victim = stack.routers[0]
            assert victim is not None and victim.popen is not None
            victim.popen.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            for thread in threads:
                thread.join(timeout=30)
            victim.popen.wait(timeout=40)
            traffic.wait_for(100)
            after = [s for s in traffic.since(signalled) if s.status]
            survivor_before = decisions(stack, 1)
            moved = placements(stack, DOCS)
            assert decisions(stack, 1) >= survivor_before + len(DOCS)
        assert victim.popen.returncode == 0, victim.log_tail()
        # Every long stream ran to its last event, on a fleet member.
        assert len(streams) == 12
        assert all(status == 200 and last == "data: [DONE]" for status, _, last in streams), streams
        assert {served for _, served, _ in streams} <= fleet
        assert traffic.routing_failures == [], traffic.summary()
        assert traffic.backend_failures == []
        # No request lost its affinity while the replica drained: the draining one kept
        # answering until Envoy's health check moved new streams to the survivor.
        assert all(s.served_by == home[s.doc] for s in after), [
            (s.doc, s.served_by, home[s.doc]) for s in after if s.served_by != home[s.doc]
        ]
        assert moved == home
        assert len(after) >= 100
        log = stack.router_log_path(0).read_text()
        assert "router_draining" in log and "router_stopped" in log


class _Context:
    async def abort(self, code: grpc.StatusCode) -> None:
        raise AssertionError(code)


async def test_drain_notice_waits_for_the_next_health_check_only_when_checked():
    from grpc_health.v1 import health_pb2

    from extproc.adapter.service import DRAIN_SETTLE_SECONDS, HealthService

    unchecked = HealthService()
    started = time.monotonic()
    await unchecked.drain_notice(timeout_s=2)
    assert time.monotonic() - started < 0.1  # nobody health-checks: no reason to wait

    service = HealthService()
    request = health_pb2.HealthCheckRequest(service="")
    await service.Check(request, _Context())  # Envoy is checking this router
    await service.enter_graceful_shutdown()
    notice = asyncio.ensure_future(service.drain_notice(timeout_s=2))
    await asyncio.sleep(0.2)  # a window in which the notice must not come
    assert not notice.done()  # still accepting streams: Envoy has not been told yet
    answer = await service.Check(request, _Context())
    assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    # Envoy's worker threads learn the answer after its main thread: still accepting.
    await asyncio.sleep(DRAIN_SETTLE_SECONDS / 5)
    assert not notice.done()
    await asyncio.wait_for(notice, timeout=DRAIN_SETTLE_SECONDS + 1)
