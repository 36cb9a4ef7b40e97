"""A replay's stored document, its recommendation, and the report rendered from it.

``document`` is everything the report says; ``render`` and ``render_plots`` read nothing
else, so ``prefix-router bench render`` renders a stored replay again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from extproc import reporting
from extproc.config import RouterConfig
from extproc.replay.replayer import DRAWS, ReplayResult, ServiceModel
from extproc.replay.run import ReplayRun

KIND = "replay"
FORMAT = 1
# The router settings a replay's PREFIX_AWARE reads beyond the grid's; stored as used.
QUOTED_SETTINGS = (
    "balance_factor",
    "balance_min_in_flight",
    "overload_cost",
    "hot_prefix_factor",
    "prefill_tokens_per_s",
    "chars_per_token",
)
# The recommendation keeps the busiest instance within this multiple of a fair share of
# the requests (their decode work).
MAX_BUSIEST_RATIO = 2.0


def recommend(results: Sequence[dict[str, Any]], max_busiest_ratio: float) -> list[int]:
    """For each fleet (instances, cache size), the configuration whose busiest instance
    would prefill the least (the fleet's bottleneck: saving prefill overall is worth little
    if it piles what is left on one instance), among those whose busiest instance takes at
    most ``max_busiest_ratio`` times a fair share of the requests; ties go to the most
    prefill saved overall. Where none is that even, the most even one. Indexes into
    ``results``."""
    fleets: dict[tuple[int, int], list[int]] = {}
    for at, result in enumerate(results):
        config = result["config"]
        fleets.setdefault((config["instances"], config["cache_tokens"]), []).append(at)
    chosen = []
    for (instances, _), members in fleets.items():
        bound = max_busiest_ratio / instances
        even = [at for at in members if results[at]["busiest_share"] <= bound]
        if even:
            chosen.append(
                min(
                    even,
                    key=lambda at: (
                        results[at]["busiest_prefill_tokens"],
                        -results[at]["saved_tokens"],
                        at,
                    ),
                )
            )
        else:
            chosen.append(min(members, key=lambda at: (results[at]["busiest_share"], at)))
    return sorted(chosen)


def result_document(result: ReplayResult) -> dict[str, Any]:
    return {
        **asdict(result),
        "label": result.config.label,
        "busiest_share": result.busiest_share,
        "busiest_prefill_tokens": max(result.host_prefill_tokens, default=0.0),
        "least_share": min(result.shares) if result.shares else 0.0,
    }


def document(
    run: ReplayRun,
    log: Path,
    command: str,
    router: RouterConfig,
    service: ServiceModel,
    max_busiest_ratio: float = MAX_BUSIEST_RATIO,
) -> dict[str, Any]:
    results = [result_document(r) for r in run.results]
    return {
        "kind": KIND,
        "format": FORMAT,
        "command": command,
        "machine": reporting.machine_description(),
        "log": str(log),
        "records": run.records,
        "skipped": run.skipped,
        "other_block_size": run.other_block_size,
        "log_block_bytes": run.log_block_bytes,
        "span_s": run.span_s,
        "cpu_s": run.cpu_s,
        "decisions_per_cpu_s": run.decisions_per_cpu_s,
        "router": {name: getattr(router, name) for name in QUOTED_SETTINGS},
        "service": {
            "output_tokens": service.output_tokens,
            "feed_interval_s": service.feed_interval_s,
            "prefill_stalls": service.prefill_stalls,
            "engine": asdict(service.engine),
        },
        "max_busiest_ratio": max_busiest_ratio,
        "draws": DRAWS,
        "results": results,
        "recommended": recommend(results, max_busiest_ratio),
    }


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def table(data: dict[str, Any]) -> str:
    """One row per configuration, grouped by fleet; the recommended ones marked."""
    recommended = set(data["recommended"])
    rows = []
    for at, result in enumerate(data["results"]):
        config = result["config"]
        rows.append(
            (
                f"{config['instances']} x {config['cache_tokens']:,}",
                ("**" + result["label"] + "** (recommended)")
                if at in recommended
                else result["label"],
                _pct(result["hit_rate"]),
                _pct(result["busiest_share"]),
                _pct(result["least_share"]),
                _pct(result["overflow_rate"]),
                f"{result['prefill_tokens']:,}",
                f"{result['busiest_prefill_tokens']:,.0f}",
                f"{result['saved_tokens']:,}",
            )
        )
    header = (
        "fleet (instances x cache tokens)",
        "configuration",
        "hit rate",
        "busiest instance",
        "least busy",
        "overflow",
        "prefill tokens",
        "of them on the busiest instance",
        "tokens saved",
    )
    return reporting.markdown_table(header, rows)


def render(data: dict[str, Any]) -> str:
    service = data["service"]
    throughput = data["decisions_per_cpu_s"]
    return f"""# What-if replay of a traffic log

Every configuration below replayed the same {data["records"]:,} requests of `{data["log"]}`
({data["span_s"]:.0f} s of traffic, blocks of {data["log_block_bytes"]} bytes) through the
router's own decision code and the simulator's model of vLLM's prefix cache.
{data["skipped"]} lines were not records and {data["other_block_size"]} records had another
block size; both were skipped.

{table(data)}

Recommended, for each fleet: the configuration whose busiest instance would prefill the
least (the fleet's bottleneck), among those whose busiest instance takes at most
{data["max_busiest_ratio"]:g} times a fair share of the requests.

## How it was computed

- Decisions: the router's code, the strategies of its own table (`strategy_table`; PREFIX_AWARE
  by longest match with the replay's own prefix index, popularity counts and pending
  prefill), over the virtual fleet's exact in-flight counts.
- The engines: the simulator's prefix cache at the log's block size (a prompt that continues
  one its instance served also hits that prompt's reply), and its engine timing on an idle
  instance with {service["output_tokens"]} output tokens a request,
  {
        "each prefill delaying the other requests on its instance"
        if service["prefill_stalls"]
        else "with no contention inside an engine"
    }; the load feed's round is
  {service["feed_interval_s"]:g} s.
- Router settings read beyond the grid: {", ".join(f"{k} {v}" for k, v in data["router"].items())}.
- RANDOM, and LEAST_OUTSTANDING_REQUESTS between equally loaded hosts, decide by a random
  draw: their rows are the mean of {data["draws"]} draws, an estimate of what to expect.
- Replay speed: {throughput:,.0f} requests a CPU second over every configuration and draw
  ({data["cpu_s"]:.2f} CPU s for {len(data["results"])} configurations).

```
{data["command"]}
```

- Machine: {data["machine"]}
"""


def render_plots(data: dict[str, Any], out_dir: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    recommended = set(data["recommended"])
    for at, result in enumerate(data["results"]):
        config = result["config"]
        x, y = 100 * result["busiest_share"], 100 * result["hit_rate"]
        axis.scatter([x], [y], marker="*" if at in recommended else "o", s=90)
        axis.annotate(
            f"{result['label']} ({config['instances']} x {config['cache_tokens']:,})",
            (x, y),
            fontsize="x-small",
            xytext=(4, 2),
            textcoords="offset points",
        )
    axis.set_xlabel("busiest instance's share of requests (%)")
    axis.set_ylabel("predicted prefix-cache hit rate (%)")
    axis.set_title("replayed configurations (star: recommended)")
    figure.tight_layout()
    figure.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(figure)
