"""The overhead benchmark end to end, at smoke size."""

import json
import os
import shutil

import pytest

from extproc.bench.overhead import OverheadOptions, chat_bodies, render, run

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None and not os.environ.get("CI"),
    reason="wrk is not installed (apt-get install wrk); CI installs it and never skips",
)


def test_chat_bodies_have_the_exact_size_and_distinct_prompts():
    bodies = chat_bodies(4, 8192)
    assert {len(b) for b in bodies} == {8192}
    assert len(set(bodies)) == 4


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
        "| c=16 | envoy+router uvloop |",
    ):
        assert path in text
    # No path may fail requests: every row's error count is 0.
    rows = [line for line in text.splitlines() if line.startswith("| c=")]
    assert all(line.rstrip(" |").endswith("| 0") for line in rows if line.count("|") == 8)
    assert (tmp_path / "overhead.png").stat().st_size > 10_000
    # The report is a rendering of the stored run: rendering the JSON again gives it back.
    stored = json.loads((tmp_path / "overhead.json").read_text())
    assert stored["kind"] == "overhead"
    assert len(stored["samples"]) == 6 * 2  # six paths at two concurrencies, one round
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


def test_the_uvloop_lever_is_compared_with_the_same_router_on_asyncio():
    paths = (("envoy", 0.6, 1000), ("envoy+router", 2.6, 400), ("envoy+router uvloop", 2.1, 500))
    samples = [
        {**_sample(path, c, p50), "requests_per_s": rps}
        for c in (1, 16)
        for path, p50, rps in paths
    ]
    data = {
        "kind": "overhead", "command": "prefix-router bench --workload overhead",
        "options": {"duration_s": 1, "rounds": 1, "concurrencies": [1, 16],
                    "body_bytes": 8192, "distinct_prompts": 16},
        "samples": samples, "machine": "test", "envoy": "test", "wrk": "test",
        "load_average_after": [0.5, 0.4, 0.3],
    }  # fmt: skip
    text = render(data)
    assert "at c=1 it adds +1.50 ms at p50 against +2.00 ms, with 1.25x the throughput" in text
    assert "| envoy+router uvloop | c=16 | +1.50 |" in text
    # A run without the path says nothing of it.
    data["samples"] = [s for s in samples if s["path"] != "envoy+router uvloop"]
    assert "uvloop instead" not in render(data)
