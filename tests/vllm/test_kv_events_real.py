"""Real vLLM's KV events through the router: the engines publish (``--kv-events-config``
on Unix sockets), the router finds them at ``GET /kv_event_sources``, decodes the token
ids with the model's own tokenizer and follows what each engine really holds."""

from __future__ import annotations

import random

import httpx

from extproc.bench.real_vllm import document_text
from extproc.stack.processes import wait_until
from extproc.stack.prometheus import by_label, scrape


def labelled(url: str, family: str, label: str) -> dict[str, float]:
    return by_label(scrape(url, timeout_s=5), family, label)


def chat(document: str, question: str) -> dict[str, object]:
    return {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": f"Answer from the document.\n{document}"},
            {"role": "user", "content": question},
        ],
    }


def test_the_router_follows_what_each_engine_holds_whoever_put_it_there(vllm_stack):
    stack, _ = vllm_stack
    stack.write_router_config(routing_strategy="PREFIX_AWARE")
    stack.restart_routers()
    metrics = stack.router_metrics_url
    hosts = stack.backend_addresses
    wait_until(
        lambda: (
            labelled(metrics, "prefix_router_kv_events_hosts", "state").get("precise") == len(hosts)
        ),
        30,
        "the router subscribed to every engine's events",
    )
    # Two documents, each put on its own engine (not the first) behind the router's back:
    # without the events, the router would place each by its hash (1 in 3 to be right).
    for seed, target in enumerate(hosts[1:]):
        document = document_text(random.Random(2026 + seed), 6000)
        before = labelled(metrics, "prefix_router_kv_events_blocks", "host").get(target, 0)
        response = httpx.post(
            f"http://{target}/v1/chat/completions", json=chat(document, "first?"), timeout=120
        )
        assert response.status_code == 200
        # ~1.7k tokens: 13 full engine blocks of 128 tokens, over 10 blocks of the key.
        wait_until(
            lambda target=target, before=before: (
                labelled(metrics, "prefix_router_kv_events_blocks", "host").get(target, 0)
                >= before + 10
            ),
            20,
            f"the document in the router's view of {target}",
        )
        routed = httpx.post(
            f"{stack.url}/v1/chat/completions", json=chat(document, "second?"), timeout=120
        )
        assert routed.status_code == 200
        assert routed.headers["x-upstream-host"] == target
