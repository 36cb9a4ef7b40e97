"""The overhead benchmark end to end, at smoke size."""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from extproc.bench import overhead
from extproc.bench.overhead import OverheadOptions, chat_bodies, render, run
from extproc.stack.local import StackSpec
from extproc.stack.processes import ManagedProcess, StackError

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None and not os.environ.get("CI"),
    reason="wrk is not installed (apt-get install wrk); CI installs it and never skips",
)


def test_chat_bodies_have_the_exact_size_and_distinct_prompts():
    bodies = chat_bodies(4, 8192)
    assert {len(b) for b in bodies} == {8192}
    assert len(set(bodies)) == 4


# Every process measure starts beside its stack, in order.
STARTS = (
    "envoy-baseline", "envoy-streamed", "router-2-workers", "envoy-2-workers",
    "router-asyncio", "envoy-asyncio", "router-unix", "envoy-unix", "envoy-fewer-headers",
    "noop-processor", "envoy-noop",
)  # fmt: skip


@pytest.mark.parametrize("failing", ["envoy-streamed", "router-unix", "envoy-noop"])
def test_a_failed_start_stops_every_process_started_before_it(tmp_path, monkeypatch, failing):
    # Each start runs an idle process in place of Envoy, a router or the noop processor,
    # until ``failing``, whose start raises: nothing started may outlive measure.
    started: list[ManagedProcess] = []

    def idle(name: str) -> ManagedProcess:
        if name == failing:
            raise StackError(f"{name} did not start")
        process = ManagedProcess(name, ["sleep", "60"], tmp_path / f"{name}.log").start()
        started.append(process)
        return process

    class Stack:  # the stack itself: started and stopped by LocalStack, not measure
        url = admin_url = "http://127.0.0.1:9"

        def __init__(self, spec: StackSpec) -> None:
            self.spec = spec

        def __enter__(self) -> "Stack":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def start_envoy_beside(self, name: str, work: Path, **changes: Any) -> Any:
            return idle(name), self.url, self.admin_url

    class Process(ManagedProcess):
        def start(self) -> ManagedProcess:
            return idle(self.name)

    monkeypatch.setattr(overhead, "LocalStack", Stack)
    monkeypatch.setattr(overhead, "start_router", lambda name, *args, **kwargs: idle(name))
    monkeypatch.setattr(overhead, "ManagedProcess", Process)
    try:
        with pytest.raises(StackError, match=f"{failing} did not start"):
            overhead.measure(OverheadOptions(out_dir=tmp_path))
        assert [p.name for p in started] == list(STARTS[: STARTS.index(failing)])
        assert all(p.popen is not None and p.popen.poll() is not None for p in started)
    finally:
        for process in started:
            process.kill()


@needs_wrk
def test_overhead_benchmark_writes_table_and_plot(tmp_path):
    report = run(OverheadOptions(duration_s=1, rounds=1, out_dir=tmp_path))
    text = report.read_text()
    for path in (
        "| c=1 | direct |",
        "| c=1 | envoy |",
        "| c=16 | envoy+router |",
        "| c=16 | envoy+router streamed |",
        "| c=16 | envoy+router 2 workers |",
        "| c=16 | envoy+router asyncio |",
        "| c=16 | envoy+router unix |",
        "| c=16 | envoy+router fewer headers |",
        "| c=16 | envoy+noop ext_proc |",
    ):
        assert path in text
    # No path may fail requests: every row's error count is 0.
    rows = [line for line in text.splitlines() if line.startswith("| c=")]
    assert all(line.rstrip(" |").endswith("| 0") for line in rows if line.count("|") == 8)
    assert (tmp_path / "overhead.png").stat().st_size > 10_000
    # The report is a rendering of the stored run: rendering the JSON again gives it back.
    stored = json.loads((tmp_path / "overhead.json").read_text())
    assert stored["kind"] == "overhead"
    assert len(stored["samples"]) == 9 * 2  # nine paths at two concurrencies, one round
    # Every ext_proc path was served by its processor: Envoy counted its streams, and none
    # failed open (a path that failed open would measure Envoy alone).
    assert set(stored["ext_proc"]) == {
        "envoy+noop ext_proc", "envoy+router", "envoy+router streamed",
        "envoy+router 2 workers", "envoy+router asyncio", "envoy+router unix",
        "envoy+router fewer headers",
    }  # fmt: skip
    for path, counts in stored["ext_proc"].items():
        assert counts["streams_started"] > 0, path
        assert counts["failure_mode_allowed"] == counts["streams_failed"] == 0, path
    assert "No stream failed open" in text
    assert "**The floor.**" in text
    assert render(stored) == text


def _sample(path: str, connections: int, p50: float) -> dict[str, object]:
    latencies = {"p50_ms": p50, "p90_ms": p50 + 1, "p99_ms": p50 + 2}
    counts = {"requests_per_s": 1000 / p50, "requests": 10, "errors": 0}
    return {"path": path, "connections": connections, **latencies, **counts}


@pytest.mark.parametrize(("routed_p50", "verdict"), [(1.1, "meets"), (2.5, "misses")])
def test_the_verdict_is_computed_from_the_samples(routed_p50, verdict):
    paths = (
        ("direct", 0.3),
        ("envoy", 0.6),
        ("envoy+router", routed_p50 + 1),
        ("envoy+router streamed", routed_p50),
    )
    samples = [
        _sample(path, c, p50 + offset)
        for c in (1, 16)
        for path, p50 in paths
        for offset in (0.0, 0.1, -0.1)  # three rounds: the median is the middle one
    ]
    data = {
        "kind": "overhead", "command": "prefix-router bench --workload overhead",
        "options": {"duration_s": 1, "rounds": 3, "concurrencies": [1, 16],
                    "body_bytes": 8192, "distinct_prompts": 16},
        "samples": samples, "machine": "test", "envoy": "test", "wrk": "test",
        "load_average_after": [0.5, 0.4, 0.3],
    }  # fmt: skip
    text = render(data)
    assert f"| envoy+router streamed | c=1 | {routed_p50 - 0.6:+.2f} |" in text
    assert f"| envoy+router | c=1 | {routed_p50 + 1 - 0.6:+.2f} |" in text
    # The verdict is the faster path's.
    added = routed_p50 - 0.6
    assert f"`envoy+router streamed`, adds {added:+.2f} ms at p50: it {verdict} the target" in text


def _run(paths: tuple[tuple[str, float, float], ...], **extra: object) -> dict[str, object]:
    samples = [
        {**_sample(path, c, p50), "requests_per_s": rps}
        for c in (1, 16)
        for path, p50, rps in paths
    ]
    return {
        "kind": "overhead", "command": "prefix-router bench --workload overhead",
        "options": {"duration_s": 1, "rounds": 1, "concurrencies": [1, 16],
                    "body_bytes": 8192, "distinct_prompts": 16},
        "samples": samples, "machine": "test", "envoy": "test", "wrk": "test",
        "load_average_after": [0.5, 0.4, 0.3], **extra,
    }  # fmt: skip


def test_each_lever_is_judged_against_the_same_router_without_it():
    text = render(
        _run(
            (
                ("envoy", 0.6, 1000),
                ("envoy+router", 2.6, 400),
                ("envoy+router asyncio", 2.1, 400),  # 0.5 ms faster, same throughput: pays
                ("envoy+router unix", 2.55, 410),  # 0.05 ms and 1.025x: within noise
                ("envoy+router fewer headers", 2.7, 440),  # 1.10x, but 3.8% slower at c=1
            )
        )
    )
    assert "| `envoy+router asyncio` | event_loop: asyncio's own loop" in text
    assert "| -0.50 | -0.50 | 1.00x | 1.00x | pays |" in text
    assert "| -0.05 | -0.05 | 1.02x | 1.02x | does not pay |" in text
    assert "| +0.10 | +0.10 | 1.10x | 1.10x | does not pay |" in text
    assert "| envoy+router asyncio | c=16 | +1.50 |" in text
    # A run without lever paths has no lever section.
    plain = render(_run((("envoy", 0.6, 1000), ("envoy+router", 2.6, 400))))
    assert "## Levers" not in plain and "**The floor.**" not in plain


def test_a_lever_pays_only_where_every_round_agrees():
    def sample(path: str, c: int, p50: float, rps: float) -> dict[str, object]:
        return {**_sample(path, c, p50), "requests_per_s": rps}

    # Three rounds; the lever is faster in the median but slower in the last round.
    samples = [
        sample(path, c, p50, 400)
        for c in (1, 16)
        for path, p50s in (("envoy", (0.6, 0.6, 0.6)), ("envoy+router", (2.6, 2.6, 2.6)),
                           ("envoy+router unix", (2.0, 2.1, 2.9)))
        for p50 in p50s
    ]  # fmt: skip
    data = _run(())
    data["samples"] = samples
    assert (
        "| -0.50 | -0.60, -0.50, +0.30 | 1.00x | 1.00x, 1.00x, 1.00x | mixed across rounds |"
        in (render(data))
    )


def test_the_floor_is_the_noop_processors_share_of_what_the_router_adds():
    paths = (("envoy", 0.6, 1000), ("envoy+noop ext_proc", 2.1, 420), ("envoy+router", 2.6, 400))
    text = render(_run(paths))
    assert "adds +1.50 ms at p50 and +1.50 ms at p99 at c=1" in text
    assert "keeps 0.42 of plain Envoy's throughput at c=16" in text
    assert "The router adds +2.00 ms at p50 and keeps 0.40: 75% of what" in text


def test_envoys_ext_proc_counters_show_any_stream_that_failed_open():
    paths = (("envoy", 0.6, 1000), ("envoy+router", 2.6, 400))
    counts = {"streams_started": 900.0, "streams_failed": 0.0, "message_timeouts": 2.0}
    text = render(_run(paths, ext_proc={"envoy+router": {**counts, "failure_mode_allowed": 2.0}}))
    assert "| `envoy+router` | 900 | 2 | 2 |" in text
    assert "2 streams failed open" in text
    clean = {"envoy+router": {**counts, "message_timeouts": 0.0, "failure_mode_allowed": 0.0}}
    assert "No stream failed open" in render(_run(paths, ext_proc=clean))


def test_the_routers_cost_is_stated_against_both_floors_when_both_ran():
    paths = (
        ("envoy", 0.6, 4000),
        ("envoy+native noop ext_proc", 1.2, 2000),  # +0.6 ms
        ("envoy+noop ext_proc", 1.6, 1600),  # +1.0 ms
        ("envoy+router", 2.0, 1300),  # +1.4 ms
    )
    data = _run(paths)
    ratios = overhead.floor_ratios(overhead.summarise(data), [1, 16])
    assert ratios is not None
    assert ratios.over_python_ms == pytest.approx(0.4)
    assert ratios.over_native == pytest.approx(1.4 / 0.6)
    assert ratios.native_throughput == pytest.approx(0.65)
    assert [met for *_, met in ratios.targets()] == [False, False, False]
    text = render(data)
    assert "## Against the floors" in text
    assert "| `envoy+native noop ext_proc` | +0.60 | +0.60 | 2,000 (0.50) |" in text
    assert "| p50 added at c=1, over the Python noop's | ≤ +0.1 ms | +0.40 ms | **no** |" in text
    # A router within every target meets each.
    within = _run((*paths[:3], ("envoy+router", 1.65, 1600)))
    met = overhead.floor_ratios(overhead.summarise(within), [1, 16])
    assert met is not None and all(m for *_, m in met.targets())
    # Without the native floor there is no such section, and no ratio.
    assert overhead.floor_ratios(overhead.summarise(_run((paths[0], *paths[2:]))), [1, 16]) is None
    assert "## Against the floors" not in render(_run((paths[0], *paths[2:])))
