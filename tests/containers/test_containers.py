"""The whole stack in containers: images as users run them, over loopback."""

from __future__ import annotations

import asyncio
import json

import docker
import httpx
import pytest

from .containers import THRESHOLD, ContainerStack, document, metric, wait_for


def chat(text: str, max_tokens: int = 1) -> dict:
    return {
        "model": "sim-model",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text[:300]
    return response.headers["x-served-by"]


def home_of(stack: ContainerStack, doc: int) -> str:
    return served_by(httpx.post(f"{stack.url}/v1/chat/completions", json=chat(document(doc))))


def test_same_prefix_goes_to_the_same_container(stack: ContainerStack):
    homes = {}
    for doc in range(12):
        seen = {home_of(stack, doc) for _ in range(5)}
        assert len(seen) == 1, f"document {doc} went to {seen}"
        homes[doc] = seen.pop()
    assert set(homes.values()) <= stack.fleet
    assert len(set(homes.values())) >= 2  # placement spreads documents over the fleet


async def test_overflow_at_the_threshold(stack: ContainerStack):
    home = home_of(stack, 7)
    body = chat(document(7), max_tokens=40)  # each held ~0.8 s by the simulator
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:

        async def one(delay: float) -> str:
            await asyncio.sleep(delay)  # staggered, so arrival order is known
            return served_by(await http.post("/v1/chat/completions", json=body))

        hosts = await asyncio.gather(*(one(i * 0.05) for i in range(THRESHOLD + 2)))
    assert hosts[:THRESHOLD] == [home] * THRESHOLD
    assert home not in hosts[THRESHOLD:]
    assert set(hosts) <= stack.fleet
    overflows = metric(
        stack.router_metrics_url, "prefix_router_overflows_total", strategy="PREFIX_AWARE"
    )
    assert overflows is not None and overflows >= 1


def test_router_restart_fails_open_then_restores_affinity(stack: ContainerStack):
    stack.wait_idle()  # else the load feed may still overflow a host the last test loaded
    homes = {doc: home_of(stack, doc) for doc in range(8)}
    stack.stop_container("router")
    # Override-host mode: without the router, Envoy falls back to its own balancing.
    for doc in range(8):
        for _ in range(3):
            assert home_of(stack, doc) in stack.fleet
    stack.start_router()
    # Envoy reconnects on its next health check; a request that beats it still fails open.
    wait_for(
        lambda: {doc: home_of(stack, doc) for doc in range(8)} == homes,
        "every document back on its home host",
        timeout=30,
    )
    for _ in range(3):  # and it stays there
        assert {doc: home_of(stack, doc) for doc in range(8)} == homes


def test_images_run_unprivileged_and_report_healthy(stack: ContainerStack):
    client = docker.from_env()
    for name in ("router", "control-plane", "sim-0"):
        container = client.containers.get(stack.containers[name].get_wrapped_container().id)
        assert container.attrs["Config"]["User"] == "10001"
        exit_code, output = container.exec_run(["id", "-u"])
        assert (exit_code, output.strip()) == (0, b"10001")

    def healthy() -> bool:
        states = [
            client.containers.get(stack.containers[n].get_wrapped_container().id).attrs["State"][
                "Health"
            ]["Status"]
            for n in ("router", "control-plane", "sim-0")
        ]
        return states == ["healthy"] * 3

    wait_for(healthy, "the image healthchecks", timeout=60)


def test_router_logs_are_structured(stack: ContainerStack):
    lines = [line for line in stack.logs("router").splitlines() if line.startswith("{")]
    assert lines, "the router logged no JSON lines"
    assert all("event" in json.loads(line) for line in lines)


@pytest.mark.parametrize("bad_body", [b"", b"{", b"\xff\xfe not utf-8", b'{"messages": 7}'])
def test_bad_bodies_still_routed_through_containers(stack: ContainerStack, bad_body: bytes):
    response = httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=bad_body,
        headers={"content-type": "application/json"},
    )
    # The simulator rejects what it can't parse; the point is that a fleet member answered.
    assert response.headers.get("x-served-by") in stack.fleet
