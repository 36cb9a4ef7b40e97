"""What sharing decisions between workers costs (``adapter/decision_exchange.py``), per
decision, beside the decision itself.

Three numbers per prompt size, each the median of several rounds:

- **decide**: ``Router.route`` of a prompt, with the exchange off (the baseline);
- **publish**: what the exchange adds to each decision on the request path: the index's
  ``on_record`` call (packing the chain, appending it), and its share of the batch's
  msgpack encoding and non-blocking ZMQ send (a PUB socket bound on ipc, batches of
  ``BATCH_MAX``);
- **apply**: what a sibling spends on it: decoding its share of the batch and recording
  the chain in its index (``PrefixIndex.record_hashes``).

Run: ``python -m extproc.bench.decision_exchange``. Prints a markdown table.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extproc import logs
from extproc.adapter.decision_exchange import BATCH_MAX, DecisionExchange
from extproc.adapter.routing import Router
from extproc.config import RouterConfig

HOSTS = tuple(f"127.0.0.{10 + i}:8000" for i in range(8))
# Prompt sizes in characters: 16 and 128 blocks of 512 bytes (the default block size).
SIZES = (8 * 1024, 64 * 1024)
DECISIONS = 2048
ROUNDS = 5


def _bodies(chars: int, count: int) -> list[bytes]:
    bodies = []
    for n in range(count):
        head = f"document {n} "
        text = head + "x" * (chars - len(head))
        message = {"role": "user", "content": text}
        bodies.append(json.dumps({"model": "m", "messages": [message]}).encode())
    return bodies


def _router(sizes_chars: int) -> Router:
    config = RouterConfig(hosts=HOSTS, kv_events=False, match_depth_chars=max(65536, sizes_chars))
    return Router(config, random.Random(1))


def _round(chars: int, bodies: list[bytes], endpoint: str) -> tuple[float, float, float]:
    """Seconds per decision: deciding alone, publishing, applying at a sibling."""
    # The baseline: decisions with no exchange.
    alone = _router(chars)
    started = time.perf_counter()
    for body in bodies:
        alone.route({}, body)
    decide = (time.perf_counter() - started) / len(bodies)

    # The same decisions on a fresh router, noted, then published apart from deciding.
    sender = _router(chars)
    decided: list[tuple[str, Sequence[int]]] = []
    sender.index.on_record = lambda host, chain: decided.append((host, chain))
    for body in bodies:
        sender.route({}, body)
    exchange = DecisionExchange(sender, endpoint, ())
    exchange.start()
    pub = exchange._pub
    assert pub is not None
    send, sent = pub.send, []

    def keep(data: bytes, flags: int = 0) -> Any:
        sent.append(data)  # kept for the sibling to apply below
        return send(data, flags)

    pub.send = keep  # type: ignore[method-assign,assignment]
    started = time.perf_counter()
    for host, chain in decided:
        exchange.publish(host, chain)
    exchange.flush()
    publish = (time.perf_counter() - started) / len(decided)
    exchange.close()

    # A sibling applies every batch.
    receiver = DecisionExchange(_router(chars), None, ())
    started = time.perf_counter()
    for data in sent:
        receiver.apply(data)
    apply = (time.perf_counter() - started) / len(decided)
    assert receiver.applied == len(decided), (receiver.applied, receiver.dropped)
    return decide, publish, apply


async def _measure(chars: int, run_dir: Path) -> dict[str, float]:
    """Medians over ROUNDS, in µs per decision (on the event loop: the exchange's timer)."""
    bodies = _bodies(chars, DECISIONS)
    rounds = [_round(chars, bodies, f"ipc://{run_dir / f'bench-{n}'}") for n in range(ROUNDS)]
    decide, publish, apply = zip(*rounds, strict=True)
    return {
        "decide_us": statistics.median(decide) * 1e6,
        "publish_us": statistics.median(publish) * 1e6,
        "apply_us": statistics.median(apply) * 1e6,
    }


async def _main() -> None:
    with tempfile.TemporaryDirectory(prefix="dx-bench-") as folder:
        print(f"decisions per round {DECISIONS}, rounds {ROUNDS}, batches of {BATCH_MAX}")
        print("| prompt | blocks | decide (µs) | publish (µs) | apply (µs) |")
        print("| --- | --- | --- | --- | --- |")
        for chars in SIZES:
            result = await _measure(chars, Path(folder))
            print(
                f"| {chars // 1024} KiB | {chars // 512} | {result['decide_us']:.1f} | "
                f"{result['publish_us']:.2f} | {result['apply_us']:.2f} |"
            )


def main(argv: list[str]) -> None:
    logs.configure("warning")  # the decisions' debug lines would be timed too
    asyncio.run(_main())


if __name__ == "__main__":
    main(sys.argv[1:])
