"""The core claim on the real engine: PREFIX_AWARE raises vLLM's own prefix-cache hit rate."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from extproc.bench.real_vllm import (
    SHADOW,
    SHADOW_SCENARIOS,
    SINGLE,
    run_order,
    run_path,
    shadow_error,
    workers_allowance,
    workers_difference,
    workers_path,
)
from extproc.control.loadfeed import parse_vllm_metrics
from extproc.picker.keys import KeyMode, extract_key
from extproc.stack.processes import wait_until
from extproc.stack.vllm import VllmOptions

from .tier import TIER_SCENARIOS, TIER_WORKERS

REPORT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "real-vllm-cpu.json"

# The first test also runs the module's fixture: three scenarios on four paths each (one
# shadowed as well), on three CPU engines sharing two cores (about six minutes).
pytestmark = pytest.mark.timeout(1500)

# How far one instance alone may fall from the stored report's hit rate on a scenario:
# one engine and the same requests in the same order. The report's run and a tier run
# here: rag 0.448 and 0.447, conversations 0.729 and 0.729.
SINGLE_DRIFT = 0.05


def stored_hit_rate(scenario: str, path: str) -> float:
    stored = json.loads(REPORT.read_text())
    (rate,) = (
        r["hit_rate"] for r in stored["results"] if (r["scenario"], r["path"]) == (scenario, path)
    )
    return float(rate)


# At most this share of a path's requests may be moved by load (failed open, retried, shed)
# rather than routed: beyond it the run says little about the routing.
MOST_MOVED_BY_LOAD = 1 / 6


@pytest.fixture(scope="module")
def results(vllm_stack, options):
    stack, _ = vllm_stack
    runs = {(s, p): run_path(stack, s, p, options) for s, p in run_order(options)}
    for (scenario, path), result in runs.items():
        print(
            f"{scenario:14} {path:22} hit {result.hit_rate:.3f} "
            f"share {result.min_share:.2f}-{result.max_share:.2f} affinity {result.affinity:.2f} "
            f"ejections {result.ejections} failed open {result.failed_open} "
            f"retried {result.retried} shed {result.shed}"
        )
    return runs


def test_prefix_aware_hit_rate_is_clearly_higher_than_random(results):
    random_rate = results["documents", "RANDOM"].hit_rate
    prefix_rate = results["documents", "PREFIX_AWARE"].hit_rate
    # Measured here: RANDOM 0.55, PREFIX_AWARE 0.81 (+0.26). Assert a safe part of it.
    assert prefix_rate >= random_rate + 0.12
    assert prefix_rate >= 0.65


@pytest.mark.parametrize("scenario", SHADOW_SCENARIOS)
def test_shadow_mode_predicts_prefix_awares_hit_rate_on_real_vllm(results, scenario):
    # Served with RANDOM while shadowing, then with PREFIX_AWARE (both from cold caches):
    # the shadow's prediction is within 5 points of vLLM's own counters under PREFIX_AWARE.
    shadowed = results[scenario, SHADOW]
    assert shadowed.predicted_hit_rate is not None
    assert shadowed.predicted_hit_rate > shadowed.hit_rate + 0.1  # it sees the gain
    error = shadow_error(list(results.values()), scenario)
    # The shadow predicts the routing's choices. A request PREFIX_AWARE's path moved by
    # load (see moved_by_load) misses where the prediction hits: at most its own prompt,
    # one request's share of the hit rate (the documents are of one length).
    prefix = results[scenario, "PREFIX_AWARE"]
    allowance = 5.0 + 100 * prefix.moved_by_load / prefix.requests
    assert error is not None and error <= allowance, (shadowed.predicted_hit_rate, error, prefix)


def test_every_request_of_a_document_reached_one_instance(results):
    prefix = results["documents", "PREFIX_AWARE"]
    assert prefix.ejections == 0, "a health-check ejection, not the routing, moved requests"
    # A document split by load, not by the routing: a request Envoy placed itself (failed
    # open), retried to the next host, or the router shed while its event loop ran late
    # (three CPU engines share two cores). Each is counted, and each explains at most one
    # split document. (A CI run and a local full run each split two documents this way.)
    assert prefix.split_groups <= prefix.moved_by_load, (
        f"{prefix.split_groups} documents split; failed open {prefix.failed_open}, "
        f"retried {prefix.retried}, shed {prefix.shed}: {prefix.hosts_per_group}"
    )
    assert prefix.moved_by_load <= MOST_MOVED_BY_LOAD * prefix.requests, prefix
    assert results["documents", "RANDOM"].affinity < 1.0  # the comparison is not rigged


@pytest.mark.parametrize("scenario", ["rag", "conversations"])
def test_defaults_keep_nine_tenths_of_one_instances_hit_rate_and_spread_the_load(
    results, options, scenario
):
    single = results[scenario, SINGLE].hit_rate
    prefix = results[scenario, "PREFIX_AWARE"]
    # There is something to keep: RANDOM runs on documents alone here (tier.py), and the
    # stored report has it losing part of one instance's hit rate on this scenario
    # (tests/bench/test_real_vllm_report.py); one engine alone on the same requests gets
    # about the report's hit rate again.
    assert single >= stored_hit_rate(scenario, SINGLE) - SINGLE_DRIFT, single
    assert prefix.hit_rate >= 0.9 * single
    # Every instance takes its part. A request moved by load (failed open: 5 of a rag run's
    # 45 once, just after the router restarted for the path) can take one request from an
    # instance, so each is allowed for.
    assert prefix.moved_by_load <= MOST_MOVED_BY_LOAD * prefix.requests, prefix
    moved = prefix.moved_by_load
    if scenario == "rag":
        # Four requests at a time: a burst of new documents spreads over the instances with
        # no prefill queued (measured: 33% each).
        assert prefix.min_share >= 0.20 - moved / prefix.requests, prefix
    else:
        # Chats start a second apart, so each new one is placed by its anchor's hash (of two
        # candidates, the less pressed cache): a dozen chats split as the hash falls
        # (docs/architecture.md, step 5). This seed's first turns rank one instance first
        # for 6 of the 11 chats after the first, and a run gave another instance only the
        # two chats it took before the system prompt was known as shared (6 of 36
        # requests). What the routing promises here is no hot spot (a fixed-length key put
        # 24 of 24 on one instance): every instance serves at least one whole chat. The
        # even split at scale is the fleet benchmarks' claim (conversations, hot-spot).
        assert min(prefix.served.values()) >= options.conversation_turns - moved, prefix


def test_the_feed_carries_each_instances_cache_size(vllm_stack):
    stack, _ = vllm_stack
    for address in stack.backend_addresses:
        load = parse_vllm_metrics(httpx.get(f"http://{address}/metrics").text, 0.0)
        # vLLM keeps one of the blocks back (its null block).
        assert load.cache_capacity_tokens in {
            VllmOptions.num_blocks * 128,
            (VllmOptions.num_blocks - 1) * 128,
        }


def test_load_feed_reads_real_metrics(vllm_stack, results):
    stack, _ = vllm_stack
    for address in stack.backend_addresses:
        load = parse_vllm_metrics(httpx.get(f"http://{address}/metrics").text, 0.0)
        assert load.prefix_cache_queries > 0
        assert load.running == 0 and load.waiting == 0  # idle between requests
    # The router has a fresh feed from the control plane's scrapes of those instances.
    age = stack.router_metric("prefix_router_load_feed_age_seconds")
    assert age is not None and age < 2.0


def test_openai_key_is_the_text_vllm_renders(vllm_stack):
    stack, _ = vllm_stack
    address = stack.backend_addresses[0]
    messages = [
        {"role": "system", "content": "You answer from the document. Document: alpha beta."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "alpha?"}],
        },
    ]
    tokens = httpx.post(
        f"http://{address}/tokenize",
        json={"model": "tiny", "messages": messages, "add_generation_prompt": True},
    ).json()["tokens"]
    rendered = httpx.post(
        f"http://{address}/detokenize", json={"model": "tiny", "tokens": tokens}
    ).json()["prompt"]
    body = json.dumps({"model": "tiny", "messages": messages}).encode()
    key = extract_key(body, {}, KeyMode.OPENAI, 65536).key.decode()
    # The key is the same text in the same order, without the template's markers.
    position = 0
    for piece in ("system", "You answer from the document. Document: alpha beta.",
                  "user", "What is alpha?"):  # fmt: skip
        assert piece in key
        position = rendered.index(piece, position)
    assert (
        rendered.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("assistant\n", "")
        == key
    )


def test_killed_instance_is_ejected(vllm_stack, results):
    stack, servers = vllm_stack
    victim = stack.backend_addresses[-1]
    servers[-1].kill()
    wait_until(lambda: victim not in stack.envoy_hosts(), 15, "the dead instance's ejection")
    wait_until(
        lambda: stack.router_metric("prefix_router_hosts") == len(servers) - 1,
        15,
        "the router to drop it",
    )


@pytest.mark.parametrize("scenario", TIER_SCENARIOS)
@pytest.mark.parametrize("workers", TIER_WORKERS)
def test_router_workers_decide_as_one_process(results, scenario, workers):
    """``router --workers N``, each worker fed every engine's KV events, gets one router
    process's hit rate on the same requests (issue 26: within 2 points), with one
    request's share allowed for each request moved by load in either run (see
    workers_allowance). Three runs of the report: documents and rag +0.0 at
    2 and 4 workers every time; conversations +0.0, +0.0 and -0.9 (4 workers, one request
    shed: 4.8 allowed). many-documents, not run here, gave +0.0, +2.6 (4 of the one
    process's requests failed open) and, at 4 workers, -8.5 with nothing moved: six new
    documents at once, placed apart by four workers (docs/benchmarks/real-vllm-cpu.md)."""
    path = workers_path(workers)
    one, many = results[scenario, "PREFIX_AWARE"], results[scenario, path]
    difference = workers_difference(list(results.values()), scenario, path)
    allowance = workers_allowance(list(results.values()), scenario, path)
    assert difference is not None and abs(difference) <= allowance, (difference, one, many)
    assert many.ejections == 0, "a health-check ejection, not the routing, moved requests"
