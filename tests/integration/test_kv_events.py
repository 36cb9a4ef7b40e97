"""The engines' KV events through the whole stack: simulators that publish as vLLM does,
routers that subscribe, and Envoy in front.

What events add over the approximate index is knowledge of what a router did not decide
itself: prompts another router (or a client going straight to an engine) put there, what
an engine held before this router started, and what a restarted engine lost. Each test
puts a prompt on an engine behind every router's back and checks the routers know.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from extproc.bench.probes import publish_resets, wait_for_empty_views
from extproc.stack.local import LocalStack, StackSpec
from extproc.stack.processes import wait_until
from extproc.stack.prometheus import by_label, scrape

from ..prompts import document
from ..reliability.stacks import NEVER_SHED
from ..reliability.test_replicas import ask_replica

pytestmark = pytest.mark.envoy

CHAT = "/v1/chat/completions"


def chat(text: str) -> dict[str, object]:
    return {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


def host_states(stack: LocalStack, replica: int = 0) -> dict[str, float]:
    samples = scrape(stack.replica_metrics_url(replica), timeout_s=5)
    return by_label(samples, "prefix_router_kv_events_hosts", "state")


def engine_blocks(stack: LocalStack, replica: int = 0) -> dict[str, float]:
    samples = scrape(stack.replica_metrics_url(replica), timeout_s=5)
    return by_label(samples, "prefix_router_kv_events_blocks", "host")


def all_precise(stack: LocalStack, replicas: int) -> bool:
    hosts = len(stack.backend_addresses)
    return all(host_states(stack, r).get("precise") == hosts for r in range(replicas))


def warm_behind_the_routers_back(stack: LocalStack, doc: int, host: str) -> None:
    """Send document ``doc`` straight to the engine at ``host``, not through Envoy."""
    response = httpx.post(f"http://{host}{CHAT}", json=chat(document(doc)), timeout=10)
    assert response.status_code == 200


def spec(**overrides: Any) -> StackSpec:
    settings = {**NEVER_SHED, **overrides.pop("router_settings", {})}
    sim_args = ("--ttft-ms", "0", "--itl-ms", "0")
    return StackSpec.ephemeral(3, sim_args=sim_args, router_settings=settings, **overrides)


def test_every_replica_routes_to_the_engine_that_holds_the_prompt_whoever_put_it_there():
    with LocalStack(spec(router_replicas=2)) as stack:
        wait_until(lambda: all_precise(stack, 2), 20, "both replicas subscribed to 3 engines")
        hosts = stack.backend_addresses
        for doc, host in enumerate(hosts):
            warm_behind_the_routers_back(stack, doc, host)
        # Both replicas learn the same thing from the same events.
        wait_until(
            lambda: all(
                all(engine_blocks(stack, r).get(h, 0) >= 10 for h in hosts) for r in range(2)
            ),
            10,
            "the documents in both replicas' views",
        )
        assert engine_blocks(stack, 0) == engine_blocks(stack, 1)
        for doc, host in enumerate(hosts):
            body = json.dumps(chat(document(doc) + " and a question")).encode()
            # Each replica alone, straight over ext_proc, and then through Envoy.
            assert ask_replica(stack, 0, body)[0] == host
            assert ask_replica(stack, 1, body)[0] == host
            through = httpx.post(stack.url + CHAT, content=body, timeout=10)
            assert through.headers["x-upstream-host"] == host


def test_a_router_that_starts_late_learns_what_the_engines_already_hold():
    with LocalStack(spec()) as stack:
        hosts = stack.backend_addresses
        stack.stop_router()
        for doc, host in enumerate(hosts):
            warm_behind_the_routers_back(stack, 10 + doc, host)
        stack.start_router()
        # Before any request: the replay socket's history is its warm-up.
        wait_until(
            lambda: all(engine_blocks(stack).get(h, 0) >= 10 for h in hosts),
            20,
            "a late router's view of every engine",
        )
        for doc, host in enumerate(hosts):
            body = json.dumps(chat(document(10 + doc) + " and a question")).encode()
            assert ask_replica(stack, 0, body)[0] == host


def test_a_restarted_engine_leaves_the_routers_view():
    # Its publisher comes back on other (free) ports: the old stream falls silent, and
    # the host goes back to discovery. (On fixed ports the new stream's seq restarting at
    # 0 clears it at once: tests/events/test_stream.py.)
    with LocalStack(spec(router_settings={"kv_events_silent_after_s": 2.0})) as stack:
        wait_until(lambda: all_precise(stack, 1), 20, "subscribed to 3 engines")
        victim = stack.backend_addresses[0]
        warm_behind_the_routers_back(stack, 20, victim)
        wait_until(lambda: engine_blocks(stack).get(victim, 0) >= 10, 10, "the document")
        index = next(i for i, s in enumerate(stack.spec.sim_backends) if f"{s[0]}:{s[1]}" == victim)
        stack.sims[index].stop()
        host, port = stack.spec.sim_backends[index]
        stack.start_sim(host, port)
        # The new engine's stream starts again from seq 0: a restart, its view emptied.
        wait_until(lambda: engine_blocks(stack).get(victim, 0) == 0, 20, "the view emptied")
        # ... and is found again on its new ports.
        wait_until(lambda: all_precise(stack, 1), 30, "the restarted engine subscribed")


def test_a_reset_reaches_the_routers_with_the_engines_next_step():
    # vLLM (and the simulator, as vLLM) publishes a reset's AllBlocksCleared at the end of
    # its next engine step: on an idle engine the routers go on seeing what it dropped.
    # The benchmarks reset between paths, so they run that step themselves.
    with LocalStack(spec()) as stack:
        wait_until(lambda: all_precise(stack, 1), 20, "subscribed to 3 engines")
        host = stack.backend_addresses[1]
        warm_behind_the_routers_back(stack, 30, host)
        wait_until(lambda: engine_blocks(stack).get(host, 0) >= 10, 10, "the document")
        held = engine_blocks(stack)[host]
        httpx.post(f"http://{host}/reset_prefix_cache", timeout=10).raise_for_status()
        assert engine_blocks(stack)[host] == held  # queued, not published: no step ran
        publish_resets(stack.backend_addresses, "sim-model")
        wait_for_empty_views(stack, len(stack.backend_addresses), timeout_s=10)
        assert engine_blocks(stack).get(host, 0) == 0
