"""The simulator's prefix-cache accounting against real vLLM's, on one request sequence.

The same prompts go to one real vLLM instance (the CPU build, 128-token blocks) and to one
simulated instance set up alike (128-token blocks, the same number of usable blocks, the
engine model at time_scale 0), one request at a time, and each request's change in
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` is compared. vLLM is
sent token ids, the simulator the same ids as text of 4 characters per token, so both count
the same tokens in the same blocks. The sequence revisits documents, then outgrows the
cache, so LRU eviction (which blocks go first) is compared too. Measured results are in
docs/benchmarks/sim-vs-vllm.md.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from extproc.control.loadfeed import parse_vllm_metrics
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port
from extproc.stack.vllm import VllmOptions, make_model, start_vllm

BLOCK_TOKENS = 128  # vLLM's block size on the CPU
NUM_BLOCKS = 130  # --num-gpu-blocks-override; vLLM keeps one back (its null block)
# (document, question tokens): five documents of 2.5k-5k tokens, ~17k tokens in all, over a
# cache of 129 x 128 = 16.5k tokens, so the later requests evict.
DOCUMENT_TOKENS = (3000, 2500, 4000, 5000, 3500)
SEQUENCE = (0, 0, 1, 0, 2, 1, 3, 0, 4, 2, 0, 3, 1, 4, 0)
QUESTION_TOKENS = 50


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(count)]  # 0-2 are special tokens


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    documents = [token_ids(rng, n) for n in DOCUMENT_TOKENS]
    return [documents[d] + token_ids(rng, QUESTION_TOKENS) for d in SEQUENCE]


def as_text(ids: list[int]) -> str:
    return "".join(f"{i:04x}" for i in ids)  # 4 characters per token, block for block


@pytest.fixture(scope="module")
def vllm_url(vllm_interpreter, tmp_path_factory):
    work = tmp_path_factory.mktemp("acct")  # short: vLLM binds IPC sockets under it
    model = make_model(vllm_interpreter, work / "model")
    host = "127.0.0.29"
    port = free_port(host)
    options = VllmOptions(model_dir=model, num_blocks=NUM_BLOCKS, max_num_seqs=1)
    (server,) = start_vllm(vllm_interpreter, options, [(host, port)], work / "vllm")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop(timeout=20)


async def per_request_counts(url: str, bodies: list[dict]) -> list[tuple[int, int]]:
    """(queries, hits) that each request added, one request at a time."""
    deltas = []
    async with httpx.AsyncClient(timeout=120) as client:

        async def read() -> tuple[float, float]:
            load = parse_vllm_metrics((await client.get(f"{url}/metrics")).text, 0.0)
            return load.prefix_cache_queries, load.prefix_cache_hits

        before = await read()
        for body in bodies:
            (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()
            after = await read()
            deltas.append((round(after[0] - before[0]), round(after[1] - before[1])))
            before = after
    return deltas


async def test_simulator_counts_prefix_cache_hits_like_vllm(vllm_url):
    sequence = prompts()
    real = await per_request_counts(
        vllm_url, [{"model": "tiny", "prompt": ids, "max_tokens": 1} for ids in sequence]
    )
    host = "127.0.0.28"
    port = free_port(host)
    options = SimOptions(
        timing="model",
        time_scale=0.0,
        block_size_tokens=BLOCK_TOKENS,
        capacity_blocks=NUM_BLOCKS - 1,
        chars_per_token=4,
    )
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], options, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        simulated = await per_request_counts(
            f"http://{host}:{port}",
            [{"model": "sim-model", "prompt": as_text(ids), "max_tokens": 1} for ids in sequence],
        )
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    print("request document vllm(queries,hits) sim(queries,hits)")
    for index, (d, r, s) in enumerate(zip(SEQUENCE, real, simulated, strict=True)):
        print(f"{index:2} doc{d} {r} {s}")
    totals = [tuple(map(sum, zip(*counts, strict=True))) for counts in (real, simulated)]
    print(f"totals vllm {totals[0]} sim {totals[1]}")
    assert [q for q, _ in simulated] == [q for q, _ in real]
    assert simulated == real
