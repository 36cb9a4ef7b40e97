"""The simulator's prefix-cache accounting against real vLLM's (extproc/bench/sim_vs_vllm.py):
a request sequence with eviction, and a multi-turn conversation that resends generated
output. Measured results are in docs/benchmarks/sim-vs-vllm.md."""

from __future__ import annotations

import pytest

from extproc.bench.sim_vs_vllm import (
    NUM_BLOCKS,
    compare_conversation,
    compare_documents,
    compare_events,
)
from extproc.stack.vllm import VllmOptions


@pytest.fixture(scope="module")
def vllm_url(vllm_stack, options):
    """The tier's first engine. It has the accounting's model and cache (NUM_BLOCKS), and
    max_num_seqs 8 instead of 1, which one request at a time never reaches: an engine of
    its own (a minute to start on 2 cores) would count the same. Each comparison resets
    the engine's prefix cache first."""
    assert options.model_shape == "tiny" and not options.vllm
    assert VllmOptions.num_blocks == NUM_BLOCKS
    stack, _ = vllm_stack
    return f"http://{stack.backend_addresses[0]}"


def show(comparison) -> None:  # type: ignore[no-untyped-def]
    print(f"{comparison.name}: request vllm(queries,hits) sim(queries,hits)")
    for label, real, simulated in zip(
        comparison.labels, comparison.vllm, comparison.simulator, strict=True
    ):
        print(f"  {label}: {real} {simulated}")


async def test_simulator_counts_prefix_cache_hits_like_vllm(vllm_url):
    comparison = await compare_documents(vllm_url)
    show(comparison)
    assert [q for q, _ in comparison.simulator] == [q for q, _ in comparison.vllm]
    assert comparison.simulator == comparison.vllm


async def test_simulator_caches_generated_output_like_vllm(vllm_url):
    comparison = await compare_conversation(vllm_url)
    show(comparison)
    # Each turn after the first hits the previous prompt and the output generated for it.
    assert all(hits > 0 for _, hits in comparison.vllm[1:])
    assert comparison.simulator == comparison.vllm


async def test_simulator_publishes_the_block_events_vllm_publishes(vllm_url):
    # The same requests, from cold caches: as many blocks stored and removed.
    comparison = await compare_events(vllm_url)
    show(comparison)
    assert comparison.vllm[0][0] > 0 and comparison.vllm[0][1] > 0  # it stores, and evicts
    assert comparison.simulator == comparison.vllm
