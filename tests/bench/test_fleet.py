"""The fleet benchmark end to end at smoke size: real Envoy, router, simulators."""

import json

from extproc.bench.fleet import FleetBenchOptions, render_report, run
from extproc.bench.fleet_options import QUICK_RATE_TIME_CONSTANT_S
from extproc.bench.workloads import WorkloadSpec


def test_fleet_benchmark_compares_paths_and_writes_reports(tmp_path):
    spec = WorkloadSpec(name="long-context", rate_per_s=6, duration_s=8, documents=10)
    options = FleetBenchOptions(
        workload=spec,
        paths=(
            "RANDOM",
            "PREFIX_AWARE",
            "PREFIX_AWARE-streamed",
            "envoy-ring-hash",
            "smg-cache-aware",
        ),
        out_dir=tmp_path,
        closed_loop_concurrency=8,
        closed_loop_requests=16,
        closed_loop_time_scale=1.0,
        closed_loop_paths=("RANDOM", "PREFIX_AWARE"),
        # Each router path first waits for the last one's cache pressure to die away:
        # about 45 s at the default 10 s, a fifth of that here.
        rate_time_constant_s=QUICK_RATE_TIME_CONSTANT_S,
    )
    results = {r.path: r for r in run(options)}
    assert not any(r.skipped for r in results.values())  # the peers are test dependencies
    assert all(r.failures == 0 and len(r.outcomes) > 20 for r in results.values())
    assert results["PREFIX_AWARE"].hit_rate > results["RANDOM"].hit_rate + 0.2
    # Behind its own Envoy that streams bodies, the same router keeps the affinity.
    assert results["PREFIX_AWARE-streamed"].hit_rate > results["RANDOM"].hit_rate + 0.2
    assert results["PREFIX_AWARE"].percentile(0.5) < results["RANDOM"].percentile(0.5)
    assert abs(sum(results["RANDOM"].shares.values()) - 1) < 1e-9
    text = (tmp_path / "long-context.md").read_text()
    assert "| PREFIX_AWARE |" in text and "p50 vs RANDOM" in text
    assert (tmp_path / "long-context-ttft.png").stat().st_size > 10_000
    assert (tmp_path / "long-context-share.png").stat().st_size > 10_000
    closed = {p: results[p].closed_loop for p in ("RANDOM", "PREFIX_AWARE")}
    assert all(c is not None and c.completed == 16 and c.failed == 0 for c in closed.values())
    assert results["smg-cache-aware"].closed_loop is None
    assert "## Throughput at saturation (closed loop)" in text
    # The report is a rendering of the stored run, which holds the run's settings.
    document = json.loads((tmp_path / "long-context.json").read_text())
    assert text == render_report(document)
    assert document["format"] == 1 and document["closed_loop"]["concurrency"] == 8
    assert document["control_plane"] == {"rate_time_constant_s": QUICK_RATE_TIME_CONSTANT_S}
    assert [r["path"] for r in document["results"]] == list(options.paths)
