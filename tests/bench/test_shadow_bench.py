"""Shadow mode's accuracy check at smoke size, as CI runs it: serve a workload with RANDOM
while shadowing, then with PREFIX_AWARE; the shadow's predicted hit rate must come within
5 points of what PREFIX_AWARE then gets. And the cost comparison runs and is reported."""

from extproc.bench import report
from extproc.bench.shadow import HIT_RATE_POINTS, VARIANTS, ShadowOptions, quick, run


def test_the_shadow_predicts_what_prefix_aware_then_gets(tmp_path):
    data = run(quick(ShadowOptions(workloads=("long-context",), out_dir=tmp_path)))
    (workload,) = data["workloads"]
    assert workload["live"]["failures"] == 0 == workload["prefix_aware"]["failures"]
    predicted, real = workload["predicted"], workload["prefix_aware"]
    # The shadow saw every request, and saw PREFIX_AWARE's gain over the live RANDOM.
    assert predicted["requests"] == workload["requests"]
    assert predicted["hit_rate"] > workload["live"]["hit_rate"] + 0.15
    assert workload["hit_rate_error"] <= HIT_RATE_POINTS, (predicted, real)
    assert abs(sum(predicted["shares"].values()) - 1) < 1e-9
    cost = workload["cost"]
    assert set(cost["median_us"]) == set(VARIANTS)
    assert all(len(values) == cost["rounds"] for values in cost["median_us"].values())
    written = (tmp_path / "shadow.md").read_text()
    report.rerender(tmp_path / "shadow.json")
    assert (tmp_path / "shadow.md").read_text() == written
    assert "Every workload's prediction within 5 points" in written
