"""What reading the engines' KV events costs a router, measured side by side.

- **Request path.** A 32k-character prompt looked up on every host of a 7-host fleet and
  recorded on one, against an index whose hosts are read from their events (each
  engine's blocks mapped from real events, plus this router's speculative blocks) and
  against the approximate index, in one run, interleaved; medians of many repetitions.
- **Ingestion.** A fleet's prompts as an engine publishes them (16-token blocks, a step's
  worth of blocks a batch, a byte-level BPE tokenizer trained here, and the simulator's
  code points), encoded in vLLM's wire format, then decoded and mirrored as a router
  does: CPU µs per engine block, the engine blocks a core ingests a second, and the share
  of a core that 100,000 blocks a second take (the issue's bound: a quarter).
- **Memory.** Bytes a mirror holds per engine block (tracemalloc).

The run's data goes to ``kv-events.json``; the markdown is rendered from it.
"""

from __future__ import annotations

import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from extproc.bench import report
from extproc.events.mirror import HostMirror
from extproc.events.tokens import CodepointDecoder, TokenDecoder, VocabDecoder
from extproc.events.wire import BlockHash, BlockStored, EventBatch, decode_batch, encode_batch
from extproc.index.precise import PreciseHost, SpeculativeBlocks
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.picker.blocks import PromptBlocks, chain_seed, prompt_blocks

# The figures: 100,000 block hashes a second, within a quarter of a core.
TARGET_BLOCKS_PER_S = 100_000
TARGET_CORE_SHARE = 0.25
MODEL = "bench-model"
WORDS = ("the", "cache", "router", "engine", "prefix", "block", "token", "of", "and", "a")


@dataclass(frozen=True)
class KvEventsOptions:
    prompt_chars: int = 32768
    hosts: int = 7
    block_bytes: int = 512
    iterations: int = 3000
    # Ingestion: prompts of this many characters, in batches of this many engine blocks.
    ingest_prompts: int = 200
    ingest_prompt_chars: int = 32768
    engine_block_tokens: int = 16
    blocks_per_batch: int = 32
    rounds: int = 3
    seed: int = 7
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = "prefix-router bench kv-events"


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS) + str(rng.randrange(1000))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def chatml(user: str) -> str:
    """The text vLLM renders for one user message with a ChatML template."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def router_key(user: str) -> bytes:
    """The router's key for the same request (``picker/keys.py``)."""
    return f"user\n{user}\n".encode()


def train_tokenizer(rng: random.Random, path: Path) -> Any:
    """A byte-level BPE tokenizer with ChatML's special tokens, trained in a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text(rng, 400) for _ in range(2000)], trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer


def engine_batches(
    token_lists: Sequence[Sequence[int]], block_tokens: int, per_batch: int
) -> list[bytes]:
    """Each prompt's full blocks as BlockStored events, ``per_batch`` blocks a batch,
    encoded as vLLM sends them. Engine hashes are distinct integers, chained by parent."""
    payloads, next_hash = [], 1
    for tokens in token_lists:
        blocks = len(tokens) // block_tokens
        parent: BlockHash | None = None
        for start in range(0, blocks, per_batch):
            count = min(per_batch, blocks - start)
            hashes: list[BlockHash] = list(range(next_hash, next_hash + count))
            next_hash += count
            ids = list(tokens[start * block_tokens : (start + count) * block_tokens])
            event = BlockStored(hashes, parent, ids, block_tokens, None, "GPU", None)
            payloads.append(encode_batch(EventBatch(time.time(), [event])))
            parent = hashes[-1]
    return payloads


def new_mirror(decoder: TokenDecoder, block_bytes: int, max_blocks: int) -> HostMirror:
    return HostMirror(
        block_bytes, decoder, lambda lora, salt: chain_seed(lora or MODEL, salt), max_blocks
    )


@dataclass
class IngestResult:
    decoder: str
    engine_blocks: int
    router_blocks: int
    cpu_us_per_block: list[float]

    @property
    def median_us(self) -> float:
        return statistics.median(self.cpu_us_per_block)


def measure_ingest(
    name: str, decoder: TokenDecoder, payloads: list[bytes], options: KvEventsOptions
) -> IngestResult:
    per_block, mirror = [], None
    blocks = 0
    for _ in range(options.rounds):
        mirror = new_mirror(decoder, options.block_bytes, 1 << 30)
        blocks = 0
        started = time.process_time()
        for payload in payloads:
            for event in decode_batch(payload).events:
                assert isinstance(event, BlockStored)
                mirror.stored(event)
                blocks += len(event.block_hashes)
        per_block.append((time.process_time() - started) * 1e6 / blocks)
    assert mirror is not None
    return IngestResult(name, blocks, len(mirror), per_block)


def bytes_per_engine_block(decoder: TokenDecoder, payloads: list[bytes], block_bytes: int) -> float:
    events = [e for p in payloads for e in decode_batch(p).events]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    mirror = new_mirror(decoder, block_bytes, 1 << 30)
    for event in events:
        assert isinstance(event, BlockStored)
        mirror.stored(event)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return grown / max(1, sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)))


@dataclass
class PathCost:
    mode: str
    lookup_us: float
    record_us: float

    @property
    def total_us(self) -> float:
        return self.lookup_us + self.record_us


def _timed(step: Callable[[], object], iterations: int) -> float:
    samples = []
    for _ in range(iterations):
        started = time.perf_counter_ns()
        step()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000


class _EngineBlocks(set[int]):
    """The router blocks an engine holds, for the lookup's cost. ``tail_bytes`` (the start
    of the block a match stops in, asked of the chosen host only) is not part of the lookup
    timed here."""

    def tail_bytes(self, chain: int, rest: bytes, /) -> int:
        return 0


def measure_request_path(
    options: KvEventsOptions, prompt: PromptBlocks, others: list[PromptBlocks]
) -> list[PathCost]:
    """Lookup on every host and record on one, for a prompt half of which one host holds,
    against an index of approximate hosts and one of hosts read from their events."""
    hosts = [f"127.0.0.{10 + i}:8000" for i in range(options.hosts)]
    sizing = IndexSizing(options.block_bytes, 1 << 22, 1_000_000, 4.0)
    half = prompt_blocks(prompt.key[: len(prompt.key) // 2], options.block_bytes, prompt.seed)
    results = []
    for mode in ("approximate", "kv-events"):
        index = PrefixIndex(sizing)
        for i, host in enumerate(hosts):
            if mode == "kv-events":
                engine = _EngineBlocks()
                for other in others[i :: options.hosts]:
                    engine.update(other.hashes)
                engine.update(half.hashes if i == 0 else ())
                view = PreciseHost(engine, SpeculativeBlocks(10.0, 1 << 20))
                index.set_precise(host, view)
            for other in others[i :: options.hosts]:
                index.record(host, index.lookup(other, [host]))
            index.record(hosts[0], index.lookup(half, [hosts[0]]))
        lookup = index.lookup(prompt, hosts)
        lookup_us = _timed(partial(index.lookup, prompt, hosts), options.iterations)
        record_us = _timed(partial(index.record, hosts[1], lookup), options.iterations)
        results.append(PathCost(mode, lookup_us, record_us))
    return results


def run(options: KvEventsOptions) -> dict[str, Any]:
    import tempfile

    rng = random.Random(options.seed)
    users = [text(rng, options.ingest_prompt_chars) for _ in range(options.ingest_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        tokenizer = train_tokenizer(rng, path)
        vocab = VocabDecoder.from_tokenizer_file(path)
    vocab_tokens = [tokenizer.encode(chatml(u)).ids for u in users]
    codepoint_tokens = [[ord(c) for c in chatml(u)] for u in users]
    vocab_payloads = engine_batches(
        vocab_tokens, options.engine_block_tokens, options.blocks_per_batch
    )
    codepoint_payloads = engine_batches(
        codepoint_tokens, options.engine_block_tokens, options.blocks_per_batch
    )
    ingest = [
        measure_ingest("byte-level BPE", vocab, vocab_payloads, options),
        measure_ingest("simulator code points", CodepointDecoder(), codepoint_payloads, options),
    ]
    seed = chain_seed(MODEL, None)
    prompt = prompt_blocks(router_key(text(rng, options.prompt_chars)), options.block_bytes, seed)
    others = [
        prompt_blocks(router_key(u), options.block_bytes, seed) for u in users[: 20 * options.hosts]
    ]
    costs = measure_request_path(options, prompt, others)
    data = {
        "kind": "kv-events",
        "options": {k: v for k, v in asdict(options).items() if k != "out_dir"},
        "machine": report.machine_description(),
        "ingest": [asdict(r) for r in ingest],
        "bytes_per_engine_block": bytes_per_engine_block(
            vocab, vocab_payloads[: len(vocab_payloads) // 4], options.block_bytes
        ),
        "request_path": [asdict(c) for c in costs],
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, "kv-events", data)
    return data


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    ingest = [IngestResult(**r) for r in data["ingest"]]
    costs = {c["mode"]: PathCost(**c) for c in data["request_path"]}
    ingest_rows = []
    for r in ingest:
        per_core = 1e6 / r.median_us
        share = TARGET_BLOCKS_PER_S / per_core
        verdict = "met" if share <= TARGET_CORE_SHARE else "not met"
        ingest_rows.append(
            [
                r.decoder,
                f"{r.engine_blocks:,}",
                f"{r.median_us:.2f}",
                f"{per_core:,.0f}",
                f"**{share:.2f}** ({verdict})",
            ]
        )
    ingest_table = report.markdown_table(
        ["token ids", "engine blocks", "CPU µs per block (median)", "blocks per core-second",
         f"share of a core at {TARGET_BLOCKS_PER_S:,} blocks/s"],
        ingest_rows,
    )  # fmt: skip
    path_rows = [
        [mode, f"{c.lookup_us:.1f}", f"{c.record_us:.1f}", f"**{c.total_us:.1f}**"]
        for mode, c in costs.items()
    ]
    path_table = report.markdown_table(
        ["hosts read from", "lookup on every host (µs)", "record (µs)", "lookup + record (µs)"],
        path_rows,
    )
    added = costs["kv-events"].total_us - costs["approximate"].total_us
    return f"""# KV events: what they cost a router

`{options["command"]}`, on {data["machine"]}. Rendered from `kv-events.json`.

## On the request path

A {options["prompt_chars"]:,}-character prompt (block {options["block_bytes"]} bytes), looked
up on each of {options["hosts"]} hosts and recorded on one, against an index whose hosts are
read from their engines' events (plus this router's speculative blocks) and against the
approximate index, medians of {options["iterations"]:,} repetitions each. No tokenizer runs
here: the request's block hashes are the same in both modes.

{path_table}

Reading hosts from their events adds **{added:.1f} µs** per request (the issue's bound:
100 µs p50 for a 32k-character prompt).

## Ingesting events

{options["ingest_prompts"]} prompts of {options["ingest_prompt_chars"]:,} characters as an
engine publishes them: {options["engine_block_tokens"]}-token blocks,
{options["blocks_per_batch"]} blocks a batch, in vLLM's wire format; each batch decoded
(msgspec), its token ids decoded to key text and chained into the router's block hashes.
Medians of {options["rounds"]} rounds of process CPU time.

{ingest_table}

A mirror holds **{data["bytes_per_engine_block"]:.0f} bytes** per engine block (tracemalloc,
byte-level BPE).
"""
