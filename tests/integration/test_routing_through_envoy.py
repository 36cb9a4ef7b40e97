"""Routing through the real Envoy binary, in both bootstrap modes."""

from __future__ import annotations

import asyncio
import json

import httpx

from extproc.stack import prometheus
from extproc.stack.local import LocalStack, envoy_counters
from extproc.stack.processes import wait_until, wait_until_async

from .conftest import THRESHOLD, fleet, streams_end_at_decision


def chat(text: str, max_tokens: int = 1, **extra) -> dict:
    return {
        "model": "sim-model",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}],
        "max_tokens": max_tokens,
        **extra,
    }


def document(n: int) -> str:
    return f"document {n}: " + "lorem ipsum dolor sit amet " * 200  # > prefix_length


def post(client: httpx.Client, body: dict, headers: dict | None = None) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body, headers=headers or {})


def served_by(response: httpx.Response) -> str:
    # The simulator names itself; Envoy's x-upstream-host must agree.
    assert response.headers["x-upstream-host"] == response.headers["x-served-by"]
    return response.headers["x-served-by"]


def test_same_prefix_reaches_the_same_upstream_every_time(stack: LocalStack, client):
    placements: dict[int, set[str]] = {}
    for question in range(8):
        for doc in range(6):
            body = chat(document(doc) + f" question {question}")
            response = post(client, body)
            assert response.status_code == 200
            placements.setdefault(doc, set()).add(served_by(response))
    assert all(len(hosts) == 1 for hosts in placements.values()), placements
    used = set().union(*placements.values())
    assert used <= fleet(stack)
    assert len(used) >= 2  # six documents do not all land on one host


def test_tenants_are_routed_independently(stack: LocalStack, client):
    shared = document(99)
    by_tenant: dict[str, set[str]] = {}
    for repeat in range(2):
        for tenant in range(12):
            headers = {"x-prefix-aware-id": f"tenant-{tenant}"}
            response = post(client, chat(shared + f" r{repeat}"), headers)
            by_tenant.setdefault(f"tenant-{tenant}", set()).add(served_by(response))
    assert all(len(hosts) == 1 for hosts in by_tenant.values())
    assert len(set().union(*by_tenant.values())) >= 2
    # The body field works as the salt too, and the header alias.
    via_body = {
        served_by(post(client, chat(shared, prompt_cache_key=f"tenant-{t}"))) for t in range(12)
    }
    assert len(via_body) >= 2
    alias = {"x-amzn-sagemaker-prefix-aware-id": "tenant-3"}
    assert by_tenant["tenant-3"] == {served_by(post(client, chat(shared + " r0"), alias))}


async def test_overflow_happens_at_the_threshold(stack: LocalStack):
    body = chat(document(7), max_tokens=40)  # held ~0.8 s each
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        home = served_by(await http.post("/v1/chat/completions", json=chat(document(7))))

        async def one(delay: float) -> str:
            await asyncio.sleep(delay)  # staggered arrivals, not a wait for anything
            return served_by(await http.post("/v1/chat/completions", json=body))

        # Staggered so arrival order is known: the first THRESHOLD fill the home host.
        hosts = await asyncio.gather(*(one(i * 0.05) for i in range(THRESHOLD + 2)))
    assert hosts[:THRESHOLD] == [home] * THRESHOLD
    assert home not in hosts[THRESHOLD:]
    assert len(set(hosts[THRESHOLD:])) == 1  # the key's consistent second host
    metrics = httpx.get(stack.router_metrics_url).text
    assert 'prefix_router_overflows_total{strategy="PREFIX_AWARE"}' in metrics


def test_client_cannot_choose_the_upstream(stack: LocalStack, client):
    sim_port = stack.spec.backends[0][1]
    admin = f"{stack.spec.admin[0]}:{stack.spec.admin[1]}"
    # Loopback targets outside the fleet: Envoy's admin, an unused address, the router.
    hostile_targets = [admin, f"127.0.0.99:{sim_port}", f"127.0.0.1:{stack.spec.router[1]}"]
    for target in hostile_targets:
        for header in ["x-target-host", "X-Target-Host", "x-envoy-original-dst-host",
                       "x-gateway-destination-endpoint"]:  # fmt: skip
            response = post(client, chat(document(3)), {header: target})
            assert response.status_code == 200
            # Served by a fleet member that the router chose (the load feed may legitimately
            # overflow it to the key's next host, so the member itself is not pinned here).
            assert served_by(response) in fleet(stack)
            assert served_by(response) != target
            assert "envoy" not in response.text.lower()[:200]


def test_request_without_a_body_is_routed(stack: LocalStack, client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert served_by(response) in fleet(stack)
    assert response.json()["data"][0]["id"] == "sim-model"


def test_streaming_responses_pass_through(stack: LocalStack, client):
    body = chat(document(1), max_tokens=5, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def in_flight(stack: LocalStack) -> dict[str, float]:
    samples = prometheus.scrape(stack.router_metrics_url)
    return prometheus.by_host(samples, "prefix_router_in_flight_requests")


async def test_client_abort_releases_the_in_flight_slot(stack: LocalStack):
    body = chat(document(11), max_tokens=250, stream=True)  # ~5 s if left to finish
    async with (
        httpx.AsyncClient(base_url=stack.url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        home = response.headers["x-served-by"]
        await wait_until_async(
            lambda: in_flight(stack).get(home) == 1, 5, what=f"{home} to count the stream"
        )
    # Leaving the block closed the connection mid-stream: the client gave up. The slot is
    # released well before the response would have finished (an idle host has no series).
    await wait_until_async(
        lambda: in_flight(stack).get(home, 0) == 0, 2, what=f"{home}'s slot to be released"
    )


def envoy_stat(stack: LocalStack, name: str) -> int:
    # The stats under the prefix ``name``: the one named ``name`` itself is the rest "".
    return int(envoy_counters(stack.admin_url, name).get("", 0))


async def test_ext_proc_streams_follow_decisions_not_responses(stack: LocalStack):
    """Responses that stream for seconds: Envoy holds their ext_proc streams open only
    when they do not end at the decision, and the router counts them in flight either way."""
    count = 6
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:

        async def one(n: int) -> int:
            body = chat(document(20 + n), max_tokens=150, stream=True)  # ~3 s each
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                return len([line async for line in response.aiter_lines() if line])

        responses = asyncio.gather(*(one(n) for n in range(count)))
        held_open = 0 if streams_end_at_decision(stack) else count

        def all_decided() -> bool:
            # Every request decided and counted, and Envoy holding the streams it keeps.
            held = envoy_stat(stack, "cluster.prefix_router.upstream_rq_active")
            return sum(in_flight(stack).values()) == count and held == held_open

        await wait_until_async(
            all_decided, 5, what=f"{count} requests counted in flight, {held_open} streams held"
        )
        assert not responses.done()  # every response still streaming
        assert all(lines > 0 for lines in await responses)
    # Every completion reached the router: nothing is left in flight.
    await wait_until_async(lambda: in_flight(stack) == {}, 2, what="no request in flight")


def test_every_envoy_worker_logs_its_completions_to_the_router(stack: LocalStack):
    """Streams that end at the decision: each Envoy worker has its own access log stream to
    the router (the fixture opened them all), so requests on new connections, which land on
    any worker, all come back done. Streams that end with the response need no log."""
    streams = stack.router_metric("prefix_router_access_log_streams")
    assert streams == (stack.envoy_workers() if streams_end_at_decision(stack) else 0)
    for n in range(12):  # a new connection each: spread over the workers
        assert httpx.post(f"{stack.url}/v1/chat/completions", json=chat(f"w{n}")).is_success
    wait_until(lambda: in_flight(stack) == {}, 2, what="no request in flight")
    assert stack.router_metric("prefix_router_unseen_decisions") == 0
