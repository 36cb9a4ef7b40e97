"""The prefix index's cost and its block size, measured.

Two parts, one run:

- **Cost.** For each block size, a 32k-character prompt (the issue's size, half of it
  matched on one host) is hashed, looked up on every host, decided and recorded, against an
  index filled to its bound; each step is timed separately, many times, and the medians are
  reported. Also the index's memory per block (tracemalloc over a filled index).
- **Quality.** The offline placement model (``extproc.bench.offline``: the real router over
  the simulator's cache model) runs each fleet workload at each block size, beside Envoy
  ring_hash's placement, for several seeds; the hit rate and the busiest instance's share
  are reported.

The run's data goes to ``prefix-index.json``; the markdown is rendered from it.
"""

from __future__ import annotations

import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from extproc.adapter.settings import load_policy
from extproc.bench import report
from extproc.bench.offline import SESSION_HASH, OfflineFleet, simulate
from extproc.bench.workloads import WorkloadName, WorkloadSpec, generate
from extproc.config import RouterConfig
from extproc.index.popularity import PrefixPopularity, heat_of
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.picker.affinity import decide_prefix
from extproc.picker.blocks import prompt_blocks
from extproc.picker.hosts import HostSet

BLOCK_SIZES = (128, 256, 512, 1024)
# (workload, rate) pairs of the quality sweep.
QUALITY_WORKLOADS: tuple[tuple[WorkloadName, float], ...] = (
    ("long-context", 4.0),
    ("long-context", 16.0),
    ("long-context-short-prefix", 16.0),
    ("conversations", 16.0),
    ("hot-spot", 16.0),
    ("multi-tenant", 16.0),
)


@dataclass(frozen=True)
class PrefixIndexOptions:
    prompt_chars: int = 32768
    hosts: tuple[int, ...] = (7, 32)
    iterations: int = 3000
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    seeds: tuple[int, ...] = (1, 2, 3)
    quality_duration_s: float = 40.0
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = ""


@dataclass
class CostResult:
    block_bytes: int
    hosts: int
    hash_us: float
    lookup_us: float
    decide_us: float
    record_us: float
    popularity_us: float
    # Reading every host's prefill queue, then adding this prompt's to one.
    queue_us: float

    @property
    def lookup_insert_us(self) -> float:
        """What the stateful producers add to a decision: hashing, lookup, record,
        popularity and the prefill queues."""
        return lookup_insert_us(asdict(self))


def lookup_insert_us(cost: dict[str, Any]) -> float:
    steps = ("hash_us", "lookup_us", "record_us", "popularity_us", "queue_us")
    return float(sum(cost[step] for step in steps))


@dataclass
class QualityResult:
    workload: str
    rate: float
    block_bytes: int  # 0: Envoy ring_hash on the session header
    hit_rates: list[float] = field(default_factory=list)
    max_shares: list[float] = field(default_factory=list)


def _median_us(step: Callable[[], object], iterations: int) -> float:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        started = clock()
        step()
        samples.append(clock() - started)
    return statistics.median(samples) / 1000


def _filled_index(block_bytes: int, hosts: HostSet, rng: random.Random) -> PrefixIndex:
    config = RouterConfig()
    index = PrefixIndex(
        IndexSizing(block_bytes, config.index_max_blocks, 250_000, config.chars_per_token)
    )
    # Fill every host to its bound with prompts of the same size.
    for host in hosts.hosts:
        while index.host_sizes().get(host.address, 0) < index.capacity_of(host.address):
            filler = rng.randbytes(block_bytes * 64)
            blocks = prompt_blocks(filler, block_bytes, 0)
            index.record(host.address, index.lookup(blocks, [host.address]))
    return index


def measure_cost(options: PrefixIndexOptions, block_bytes: int, hosts_count: int) -> CostResult:
    rng = random.Random(f"cost:{block_bytes}:{hosts_count}")
    hosts = HostSet.of([f"127.0.1.{i + 1}:8000" for i in range(hosts_count)])
    addresses = [h.address for h in hosts.hosts]
    index = _filled_index(block_bytes, hosts, rng)
    popularity = PrefixPopularity()
    key = rng.randbytes(options.prompt_chars // 2).hex().encode()[: options.prompt_chars]
    # Half of the prompt is already on one host, as for a conversation's next turn.
    index.record(
        addresses[0],
        index.lookup(prompt_blocks(key[: len(key) // 2], block_bytes, 7), addresses[:1]),
    )
    blocks = prompt_blocks(key, block_bytes, 7)
    lookup = index.lookup(blocks, addresses)
    heat = heat_of(popularity, blocks, len(hosts), 1.0)
    config = RouterConfig()
    policy = load_policy(config)
    loads = {a: rng.randrange(8) for a in addresses}
    queues = PendingPrefill(config.prefill_tokens_per_s or 30_000.0)
    for address in addresses:  # every host has prefill queued, none drained yet
        queues.add(address, rng.randrange(1, 1 << 16), 0.0)
    queued = queues.snapshot(0.0)

    def queue_step() -> None:
        queues.snapshot(0.0)
        queues.add(addresses[0], len(key), 0.0)

    n = options.iterations
    return CostResult(
        block_bytes=block_bytes,
        hosts=hosts_count,
        hash_us=_median_us(lambda: prompt_blocks(key, block_bytes, 7), n),
        lookup_us=_median_us(lambda: index.lookup(blocks, addresses), n),
        decide_us=_median_us(
            lambda: decide_prefix(lookup, heat, hosts, loads, {}, policy, 2, queued), n
        ),
        record_us=_median_us(lambda: index.record(addresses[0], lookup), n),
        popularity_us=_median_us(lambda: popularity.observe_prompt(blocks), n),
        queue_us=_median_us(queue_step, n),
    )


def bytes_per_block(block_bytes: int = 512, blocks: int = 200_000) -> float:
    """Memory the index takes per block held, over a filled index of ``blocks``."""
    sizing = IndexSizing(block_bytes, blocks, blocks * block_bytes, 1.0)
    rng = random.Random("memory")
    prompts = [
        prompt_blocks(rng.randbytes(block_bytes * 64), block_bytes, 0) for _ in range(blocks // 64)
    ]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(sizing)
    for blocks_of in prompts:
        index.record("127.0.1.1:8000", index.lookup(blocks_of, ["127.0.1.1:8000"]))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / len(index)


def measure_quality(options: PrefixIndexOptions) -> list[QualityResult]:
    fleet = OfflineFleet()
    results: list[QualityResult] = []
    for workload, rate in QUALITY_WORKLOADS:
        # Conversations run three times as long: their turns come seconds apart.
        duration = options.quality_duration_s * (3 if workload == "conversations" else 1)
        rows = {size: QualityResult(workload, rate, size) for size in (0, *options.block_sizes)}
        for seed in options.seeds:
            spec = WorkloadSpec(name=workload, rate_per_s=rate, duration_s=duration, seed=seed)
            requests = generate(spec)
            for size, row in rows.items():
                if size:
                    outcome = simulate(requests, fleet, {"block_bytes": size})
                else:
                    outcome = simulate(requests, fleet, path=SESSION_HASH)
                row.hit_rates.append(outcome.hit_rate)
                row.max_shares.append(outcome.max_share)
        results.extend(rows.values())
    return results


def run(options: PrefixIndexOptions) -> dict[str, Any]:
    costs = [
        measure_cost(options, size, hosts)
        for size in options.block_sizes
        for hosts in options.hosts
    ]
    data = {
        "kind": "prefix-index",
        "options": {k: v for k, v in asdict(options).items() if k != "out_dir"},
        "machine": report.machine_description(),
        "costs": [asdict(c) for c in costs],
        "bytes_per_block": bytes_per_block(),
        "default_block_bytes": RouterConfig().block_bytes,
        "default_max_blocks": RouterConfig().index_max_blocks,
        "quality": [asdict(q) for q in measure_quality(options)],
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, "prefix-index", data)
    return data


def render(data: dict[str, Any]) -> str:
    costs = [CostResult(**c) for c in data["costs"]]
    cost_rows = [
        [
            c.block_bytes,
            c.hosts,
            f"{c.hash_us:.1f}",
            f"{c.lookup_us:.1f}",
            f"{c.record_us:.1f}",
            f"{c.popularity_us:.1f}",
            f"{c.queue_us:.1f}",
            f"**{c.lookup_insert_us:.1f}**",
            f"{c.decide_us:.1f}",
        ]
        for c in costs
    ]
    cost_table = report.markdown_table(
        ["block (bytes)", "hosts", "hash", "lookup", "record", "popularity",
         "prefill queue", "lookup + insert", "decide"],
        cost_rows,
    )  # fmt: skip
    quality = [QualityResult(**q) for q in data["quality"]]
    sizes = sorted({q.block_bytes for q in quality if q.block_bytes})
    rows = []
    for workload, rate in dict.fromkeys((q.workload, q.rate) for q in quality):
        row = [workload, f"{rate:g}"]
        for size in [0, *sizes]:
            (q,) = [
                x for x in quality if (x.workload, x.rate, x.block_bytes) == (workload, rate, size)
            ]
            row.append(f"{statistics.mean(q.hit_rates):.1%} / {statistics.mean(q.max_shares):.0%}")
        rows.append(row)
    quality_table = report.markdown_table(
        ["workload", "req/s", "ring_hash", *[f"{s} B" for s in sizes]], rows
    )
    default = data["default_block_bytes"]
    chosen = next(
        c for c in costs if c.block_bytes == default and c.hosts == min(x.hosts for x in costs)
    )
    megabytes = data["bytes_per_block"] * data["default_max_blocks"] / 2**20
    options = data["options"]
    return f"""# Prefix index: cost and block size

<!-- Rendered from prefix-index.json by extproc/bench/prefix_index.py. -->

## Cost per decision

A {options["prompt_chars"]}-character prompt, half of it already on one host, against an
index filled to its bound; median microseconds of {options["iterations"]} runs of each
step, on this shared machine. "lookup + insert" is what the index adds to a decision:
hashing the blocks, the lookup on every host, recording the prompt on its host,
counting it for popularity, and reading the hosts' prefill queues then adding the
prompt's to its host's. "decide" is the pure decision over the lookup.

{cost_table}

At the default block of {default} bytes and {chosen.hosts} hosts, lookup plus insert costs
{chosen.lookup_insert_us:.1f} µs. The index holds {data["bytes_per_block"]:.0f} bytes per
block (tracemalloc over a filled index), so its default bound of
{data["default_max_blocks"]:,} blocks is about {megabytes:.0f} MiB.

## Block size against hit rate

The offline placement model (the router's own decision code over the simulator's cache
model, 7 instances, no processes) for each fleet workload, mean over seeds
{", ".join(str(s) for s in options["seeds"])}: hit rate / busiest instance's share of
requests, beside Envoy ring_hash's placement on the same requests.

{quality_table}

## Reproduce

```
{options["command"] or "prefix-router bench --workload prefix-index"}
```

- Machine: {data["machine"]}
"""
