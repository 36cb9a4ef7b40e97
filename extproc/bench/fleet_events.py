"""Fleet events: how many prefixes move when the fleet scales 3→4→3, and how long a dead
host takes to leave Envoy's and the router's host sets, with the control plane's defaults.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from extproc.bench import report
from extproc.control.config import ControlPlaneConfig
from extproc.stack.local import INSTANT_PREFILL, LocalStack, StackSpec
from extproc.stack.processes import free_port, wait_until

log = structlog.get_logger("bench")


def document(n: int) -> str:
    return f"document {n}: " + "the quick brown fox jumps over the lazy dog " * 200


def placements(url: str, docs: Iterable[int]) -> dict[int, str]:
    """Where each document's prefix is served (every request must succeed)."""
    result = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        for doc in docs:
            body = {
                "model": "sim-model",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": document(doc)}],
            }
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            result[doc] = response.headers["x-upstream-host"]
    return result


def moved(before: dict[int, str], after: dict[int, str]) -> float:
    return sum(before[d] != after[d] for d in before) / len(before)


@dataclass(frozen=True)
class FleetEventOptions:
    prefixes: int = 200
    rounds: int = 3
    out_dir: Path = Path("docs/benchmarks")


@dataclass(frozen=True)
class RoundResult:
    # Prefixes already served (so cached) before the 4th host joined that moved to it.
    cached_moved_3_to_4: float
    # Share of new prefixes, first seen with 4 hosts, that the 4th host took.
    new_on_4th: float
    # Of those new prefixes, the share that moved when the 4th host left.
    moved_4_to_3: float
    restored: bool
    envoy_update_s: float
    ejection_envoy_s: float
    ejection_router_s: float


def _timed(check, what: str, timeout: float = 30) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    wait_until(check, timeout, what)
    return time.monotonic() - started


def one_round(options: FleetEventOptions) -> RoundResult:
    # Caches that hold every prefix sent (2 x 200 of ~2.2k tokens over 3 hosts): a prefix
    # the engine evicted may rightly move, and would blur what "cached" measures.
    spec = StackSpec.ephemeral(
        3,
        sim_args=("--ttft-ms", "0", "--itl-ms", "0", "--capacity-blocks", "40000"),
        router_settings=INSTANT_PREFILL,
    )
    docs = range(options.prefixes)
    fresh = range(options.prefixes, 2 * options.prefixes)
    with LocalStack(spec) as stack:
        three = set(stack.backend_addresses)
        before = placements(stack.url, docs)
        extra = ("127.0.0.14", free_port("127.0.0.14"))
        extra_address = f"{extra[0]}:{extra[1]}"
        stack.start_sim(*extra)
        stack.write_control_plane_config(hosts=[*stack.backend_addresses, extra_address])
        envoy_update = _timed(
            lambda: (
                stack.envoy_hosts() == three | {extra_address}
                and stack.router_metric("prefix_router_hosts") == 4
            ),
            "the 4th host",
        )
        grown = placements(stack.url, docs)
        newcomers = placements(stack.url, fresh)
        stack.write_control_plane_config(hosts=stack.backend_addresses)
        _timed(lambda: stack.router_metric("prefix_router_hosts") == 3, "back to 3")
        _timed(lambda: stack.envoy_hosts() == three, "envoy back to 3")
        shrunk = placements(stack.url, docs)
        newcomers_after = placements(stack.url, fresh)

        victim = stack.backend_addresses[0]
        stack.sims[0].kill()
        killed = time.monotonic()
        wait_until(lambda: victim not in stack.envoy_hosts(), 30, "ejection from envoy")
        ejection_envoy = time.monotonic() - killed
        wait_until(lambda: stack.router_metric("prefix_router_hosts") == 2, 30, "router ejection")
        ejection_router = time.monotonic() - killed
    on_4th = {d for d, host in newcomers.items() if host == extra_address}
    return RoundResult(
        moved(before, grown),
        len(on_4th) / len(newcomers),
        moved(newcomers, newcomers_after),
        shrunk == before
        and all(newcomers_after[d] == newcomers[d] for d in fresh if d not in on_4th),
        envoy_update,
        ejection_envoy,
        ejection_router,
    )


def run(options: FleetEventOptions) -> Path:
    results = []
    for number in range(options.rounds):
        result = one_round(options)
        log.info("bench.fleet_round", round=number, **result.__dict__)
        results.append(result)
    health = ControlPlaneConfig().health
    data = {
        "kind": "fleet-events",
        "format": 1,
        "command": f"prefix-router bench fleet-events --rounds {options.rounds} "
        f"--out {options.out_dir}",
        "prefixes": options.prefixes,
        "rounds": [asdict(r) for r in results],
        # The control plane's defaults the run used.
        "health": health.model_dump(),
        "machine": report.machine_description(),
    }
    return report.write_rendered(options.out_dir, "fleet-events", data)


# What the measures should be: none of the cached prefixes moves when a host joins, and the
# newcomer takes at least its fair share of new ones.
EXPECTED_CACHED_MOVED = 0.0
EJECTION_BOUND_S = 2.5


def render(data: dict[str, Any]) -> str:
    rounds = [RoundResult(**r) for r in data["rounds"]]
    count = len(rounds)

    def median(values: list[float], digits: int) -> str:
        return f"{report.median(values):.{digits}f}"

    def spread(values: list[float], digits: int) -> str:
        return f"{min(values):.{digits}f} to {max(values):.{digits}f}"

    cached = [r.cached_moved_3_to_4 for r in rounds]
    taken = [r.new_on_4th for r in rounds]
    back = [r.moved_4_to_3 for r in rounds]
    update = [r.envoy_update_s for r in rounds]
    envoy = [r.ejection_envoy_s for r in rounds]
    router = [r.ejection_router_s for r in rounds]
    restored = sum(r.restored for r in rounds)
    rows = [
        ["cached prefixes moved to the 4th host", median(cached, 3), "0", spread(cached, 3)],
        ["new prefixes the 4th host took", median(taken, 3), "1/4 or more", spread(taken, 3)],
        ["new prefixes moved, 4 to 3", median(back, 3), "those on the 4th", spread(back, 3)],
        ["every other prefix kept its host after 4 to 3", f"{restored}/{count}", "all rounds", ""],
        ["config edit to 4th host in Envoy and router (s)", median(update, 2), "", ""],
        ["SIGKILL to ejected from Envoy (s)", median(envoy, 2), f"under {EJECTION_BOUND_S}",
         spread(envoy, 2)],
        ["SIGKILL to ejected from the router (s)", median(router, 2), "", spread(router, 2)],
    ]  # fmt: skip
    table = report.markdown_table(["measure", "median", "expected", "range"], rows)
    held = [
        ("no cached prefix moved when the 4th host joined", max(cached) == EXPECTED_CACHED_MOVED),
        ("the 4th host took at least 1/4 of the new prefixes", min(taken) >= 0.25),
        ("only the 4th host's prefixes moved when it left", restored == count),
        (f"Envoy ejected the dead host within {EJECTION_BOUND_S} s", max(envoy) < EJECTION_BOUND_S),
    ]
    verdicts = "\n".join(
        f"- {'held' if ok else 'did not hold'} in every round: {claim}" for claim, ok in held
    )
    health = data["health"]
    prefixes = data["prefixes"]
    return f"""# Fleet events

Scaling and failure with the control plane's **default** settings (health checks every
{health["interval_s"]:g} s, {health["timeout_s"]:g} s timeout, ejection after
{health["unhealthy_threshold"]} failures, admission after {health["healthy_threshold"]}
successes). Each round starts a fresh stack (3 simulated backends, the control plane, the
router, Envoy in override-host mode), records where {prefixes} distinct prefixes are served,
adds a 4th backend by editing the control plane's config file, sends those prefixes again
and {prefixes} new ones, removes the 4th backend, sends both sets again, then SIGKILLs a
backend. Median of {count} rounds.

{table}

What this run shows, round by round:

{verdicts}

![fleet events](fleet-events.png)

## Reproduce

```
{data["command"]}
```

- Machine: {data["machine"]}
"""


def render_plots(data: dict[str, Any], out_dir: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [RoundResult(**r) for r in data["rounds"]]
    figure, (moves, times) = plt.subplots(1, 2, figsize=(10, 4))
    rounds = range(1, len(results) + 1)
    moves.bar(
        [r - 0.2 for r in rounds],
        [r.cached_moved_3_to_4 for r in results],
        0.2,
        label="cached, moved 3 to 4",
    )
    moves.bar([r for r in rounds], [r.new_on_4th for r in results], 0.2, label="new, on the 4th")
    moves.bar(
        [r + 0.2 for r in rounds], [r.moved_4_to_3 for r in results], 0.2, label="new, moved 4 to 3"
    )
    moves.axhline(0.25, color="black", linestyle="--", label="ideal 1/4")
    moves.set_xlabel("round")
    moves.set_ylabel("fraction of prefixes")
    moves.set_xticks(list(rounds))
    moves.legend()
    labels = ["4th host admitted", "ejected (Envoy)", "ejected (router)"]
    values = [
        [r.envoy_update_s for r in results],
        [r.ejection_envoy_s for r in results],
        [r.ejection_router_s for r in results],
    ]
    times.boxplot(values)
    times.set_xticks([1, 2, 3], labels)
    times.set_ylabel("seconds")
    figure.suptitle("Fleet events with default control-plane settings")
    figure.tight_layout()
    figure.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(figure)
