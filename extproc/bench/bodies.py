"""Body sizes: a ladder of request bodies from 0 B to past the router's max_body_bytes,
through the real Envoy and router, each size sent ``repeats`` times in each way of
uploading it.

Each variant (Envoy mode x body mode) runs on a fresh stack at its defaults (Envoy's
buffer limit from the generated bootstrap, the router's max_body_bytes) with simulated
vLLM backends, which echo the SHA-256 and length of the body they received. A body is a
chat completion whose size is made up by a base64 image (no text for the model to
prefill), or nothing at all for 0 B. It is uploaded with a content-length (``fixed``),
chunked in 64 KiB pieces (``chunked``), or chunked in 16 pieces with a pause before each
(``slow-drip``). Each request ends one of four ways:

- ``delivered``: the upstream received it byte for byte (its echo matches);
- ``refused``: a 413 (a body over max_body_bytes must get the router's, which names the
  limit, within ``refuse_bound_s`` plus the slow drip's pauses);
- ``failed``: any other answer, a damaged body, or a connection error;
- ``hung``: no answer within ``timeout_s``.

The ladder holds when every body up to max_body_bytes was delivered and every larger one
refused (or, in override-host mode, which fails open, delivered whole). The run is stored
as ``bodies.json``; the markdown is rendered from it alone.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from extproc.bench import report
from extproc.config import RouterConfig
from extproc.stack.bootstrap import BootstrapParams
from extproc.stack.local import INSTANT_PREFILL, LocalStack, StackSpec, envoy_binary

log = structlog.get_logger("bench")

KiB, MiB = 1024, 1024 * 1024
MAX_BODY = RouterConfig.model_fields["max_body_bytes"].default
UPLOADS = ("fixed", "chunked", "slow-drip")
VARIANTS = (
    ("override-host", "buffered-partial"),
    ("original-dst", "buffered-partial"),
    ("override-host", "streamed"),
    ("original-dst", "streamed"),
)
_HEAD = (
    b'{"model":"sim-model","max_tokens":1,"messages":[{"role":"user","content":['
    b'{"type":"text","text":"describe this"},'
    b'{"type":"image_url","image_url":{"url":"data:image/png;base64,'
)
_TAIL = b'"}}]}]}'


@dataclass(frozen=True)
class BodyOptions:
    sizes: tuple[int, ...] = (
        0,
        1 * KiB,
        64 * KiB,
        1 * MiB,
        8 * MiB - 4 * KiB,
        9 * MiB,
        12 * MiB,
        16 * MiB,
        MAX_BODY,
        MAX_BODY + 1 * MiB,
        48 * MiB,
        64 * MiB,
        96 * MiB,
    )
    repeats: int = 20
    uploads: tuple[str, ...] = UPLOADS
    variants: tuple[tuple[str, str], ...] = VARIANTS
    timeout_s: float = 30.0
    refuse_bound_s: float = 2.0
    drip_pieces: int = 16
    drip_pause_s: float = 0.02
    backends: int = 2
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = "prefix-router bench bodies"


def body_of_size(size: int) -> bytes:
    """A valid chat completion of exactly ``size`` bytes (its image padded to fit), or
    zeros when even the smallest such body is larger."""
    padding = size - len(_HEAD) - len(_TAIL)
    if padding < 0:
        return b"0" * size
    return _HEAD + b"A" * padding + _TAIL


def _pieces(body: bytes, upload: str, options: BodyOptions) -> bytes | Iterator[bytes]:
    if upload == "fixed":
        return body
    if upload == "chunked":
        return (body[i : i + 64 * KiB] for i in range(0, len(body), 64 * KiB))
    step = max(1, -(-len(body) // options.drip_pieces))

    def drip() -> Iterator[bytes]:
        for i in range(0, len(body), step):
            time.sleep(options.drip_pause_s)
            yield body[i : i + step]

    return drip()


def send(client: httpx.Client, body: bytes, upload: str, options: BodyOptions) -> dict[str, Any]:
    """One upload: how it ended, and the seconds from its start to its answer."""
    started = time.monotonic()
    try:
        response = client.post(
            "/v1/chat/completions",
            content=_pieces(body, upload, options),
            headers={"content-type": "application/json"},
        )
    except httpx.TimeoutException:
        return {"outcome": "hung", "s": round(time.monotonic() - started, 3)}
    except httpx.HTTPError as error:
        return {"outcome": "failed", "error": type(error).__name__, "s": 0.0}
    seconds = round(time.monotonic() - started, 3)
    echoed = response.headers.get("x-request-body-sha256")
    if echoed is not None:
        whole = echoed == hashlib.sha256(body).hexdigest() and response.headers.get(
            "x-request-body-bytes"
        ) == str(len(body))
        return {
            "outcome": "delivered" if whole else "failed",
            "status": response.status_code,
            "s": seconds,
        }
    if response.status_code == 413:
        # Whose refusal: the router's carries its reason, an Envoy local reply does not.
        by_router = b"exceeds" in response.content
        return {"outcome": "refused", "status": 413, "s": seconds, "router": by_router}
    return {"outcome": "failed", "status": response.status_code, "s": seconds}


def measure_variant(mode: str, body_mode: str, options: BodyOptions) -> list[dict[str, Any]]:
    spec = StackSpec.ephemeral(
        options.backends,
        mode=mode,
        body_mode=body_mode,
        sim_args=("--ttft-ms", "0", "--itl-ms", "1"),
        router_settings=dict(INSTANT_PREFILL),
    )
    cells = []
    with (
        LocalStack(spec) as stack,
        httpx.Client(base_url=stack.url, timeout=options.timeout_s) as client,
    ):
        for size in options.sizes:
            body = body_of_size(size)
            for upload in options.uploads:
                results = [send(client, body, upload, options) for _ in range(options.repeats)]
                cell = {"mode": mode, "body_mode": body_mode, "size": size, "upload": upload}
                cells.append(cell | {"results": results})
                log.info("bodies.cell", **cell, outcomes=_counts(results))
    return cells


def _counts(results: list[dict[str, Any]]) -> dict[str, int]:
    counts = dict.fromkeys(("delivered", "refused", "failed", "hung"), 0)
    for result in results:
        counts[result["outcome"]] += 1
    return counts


def cell_holds(cell: dict[str, Any], max_body: int, options: dict[str, Any]) -> bool:
    """Every body up to max_body delivered; every larger one refused, promptly. Envoy
    hands the router a BUFFERED_PARTIAL body in one message, and when the answer to tens
    of MiB comes after message_timeout (a busy machine), Envoy goes on as the mode
    promises: override-host fails open (the body may arrive whole), original-dst fails
    closed (Envoy's 504, promptly)."""
    if cell["size"] <= max_body:
        return all(r["outcome"] == "delivered" for r in cell["results"])
    fails_open = cell.get("mode") == "override-host"
    fails_closed = cell.get("mode") == "original-dst"
    # A refusal comes once the client has sent enough to earn it: the slow drip's pauses
    # are upload time.
    drip_s = (
        options["drip_pieces"] * options["drip_pause_s"] if cell["upload"] == "slow-drip" else 0
    )
    bound = options["refuse_bound_s"] + drip_s
    return all(
        (r["outcome"] == "refused" and r.get("router") and r["s"] <= bound)
        or (fails_open and r["outcome"] == "delivered")
        or (
            fails_closed and r["outcome"] == "failed" and r.get("status") == 504 and r["s"] <= bound
        )
        for r in cell["results"]
    )


def run(options: BodyOptions) -> dict[str, Any]:
    cells: list[dict[str, Any]] = []
    for mode, body_mode in options.variants:
        cells += measure_variant(mode, body_mode, options)
    data = {
        "kind": "bodies",
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "max_body_bytes": MAX_BODY,
        "buffer_limit_bytes": BootstrapParams.buffer_limit_bytes,
        "machine": report.machine_description(),
        "envoy": report.tool_version([envoy_binary(), "--version"]),
        "cells": cells,
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, "bodies", data)
    return data


def holds(data: dict[str, Any]) -> bool:
    return all(cell_holds(c, data["max_body_bytes"], data["options"]) for c in data["cells"])


def _size(size: int) -> str:
    if size >= MiB and size % MiB == 0:
        return f"{size // MiB} MiB"
    if size >= MiB:
        return f"{size / MiB:.2f} MiB"
    return f"{size // KiB} KiB" if size >= KiB else f"{size} B"


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    max_body, bound = data["max_body_bytes"], options["refuse_bound_s"]
    rows = []
    for cell in data["cells"]:
        counts = _counts(cell["results"])
        times = sorted(r["s"] for r in cell["results"])
        rows.append(
            [
                f"{cell['mode']}, {cell['body_mode']}",
                _size(cell["size"]),
                cell["upload"],
                counts["delivered"],
                counts["refused"],
                counts["failed"],
                counts["hung"],
                f"{times[len(times) // 2]:.2f}" if times else "",
                f"{times[-1]:.2f}" if times else "",
                "yes" if cell_holds(cell, max_body, options) else "**no**",
            ]
        )
    table = report.markdown_table(
        ["variant (Envoy mode, body mode)", "body", "upload", "delivered", "refused (413)",
         "failed", "hung", "median s", "slowest s", "as it should"],
        rows,
    )  # fmt: skip
    total = sum(len(c["results"]) for c in data["cells"])
    hung = sum(_counts(c["results"])["hung"] for c in data["cells"])
    bad = [c for c in data["cells"] if not cell_holds(c, max_body, options)]
    verdict = (
        f"**Held:** all {total:,} requests ended as they should; none hung."
        if not bad
        else f"**Did not hold:** {len(bad)} of {len(data['cells'])} cells did not end as they "
        f"should; {hung} of {total:,} requests hung."
    )
    return f"""# Request bodies from 0 B to past the limit

Each body size goes through the real Envoy and the router at their defaults (Envoy's
listener buffer limit {_size(data["buffer_limit_bytes"])}, the router's `max_body_bytes`
{_size(max_body)}) to simulated vLLM instances that echo the SHA-256 and length of what
they received, {options["repeats"]} times in each way of uploading it: with a
content-length (`fixed`), chunked in 64 KiB pieces (`chunked`), and chunked in
{options["drip_pieces"]} pieces with a {options["drip_pause_s"] * 1000:g} ms pause before
each (`slow-drip`). A body is a chat completion padded with a base64 image (0 B: empty).
Every body up to `max_body_bytes` must arrive byte for byte (`delivered`, whatever the
upstream answered); every larger one must be refused with 413 within {bound:g} s of its
last byte (`refused`). When the router's answer to a body that large comes after
`message_timeout` (on a busy machine), Envoy goes on as the mode promises: in
override-host mode it fails open (the body may arrive whole), in original-dst mode it
fails closed (Envoy's 504, within the same time). `hung`: no answer in {options["timeout_s"]:g} s.
Times are from the start of the upload to the answer.

{verdict}

{table}

## Reproduce

```
{options["command"]}
```

- Machine: {data["machine"]}
- Envoy: {data["envoy"]}
"""
