"""The simulator's prefix-cache accounting against real vLLM's (extproc/bench/sim_vs_vllm.py):
a request sequence with eviction, and a multi-turn conversation that resends generated
output. Measured results are in docs/benchmarks/sim-vs-vllm.md."""

from __future__ import annotations

import pytest

from extproc.bench.sim_vs_vllm import (
    compare_conversation,
    compare_documents,
    compare_events,
    vllm_options,
)
from extproc.stack.processes import free_port
from extproc.stack.vllm import make_model, start_vllm


@pytest.fixture(scope="module")
def vllm_url(vllm_interpreter, tmp_path_factory):
    work = tmp_path_factory.mktemp("acct")  # short: vLLM binds IPC sockets under it
    model = make_model(vllm_interpreter, work / "model")
    host = "127.0.0.29"
    port = free_port(host)
    (server,) = start_vllm(vllm_interpreter, vllm_options(model), [(host, port)], work / "vllm")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop(timeout=20)


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
