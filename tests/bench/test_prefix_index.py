"""The prefix-index benchmark and the offline placement model it runs, at smoke size."""

from __future__ import annotations

import json

from extproc.bench.offline import SESSION_HASH, OfflineFleet, simulate
from extproc.bench.prefix_index import PrefixIndexOptions, measure_cost, render, run
from extproc.bench.workloads import WorkloadSpec, generate


def test_the_offline_model_ranks_the_strategies_as_a_fleet_does():
    requests = generate(WorkloadSpec(name="long-context", rate_per_s=8, duration_s=20))
    fleet = OfflineFleet()
    prefix = simulate(requests, fleet)
    random = simulate(requests, fleet, {"routing_strategy": "RANDOM"})
    session = simulate(requests, fleet, path=SESSION_HASH)
    assert prefix.hit_rate > random.hit_rate + 0.25
    assert abs(prefix.hit_rate - session.hit_rate) < 0.05
    assert prefix.requests == len(requests) == sum(prefix.outcomes.values())
    assert abs(sum(prefix.shares.values()) - 1) < 1e-9


def test_the_offline_model_runs_router_replicas_side_by_side():
    requests = generate(WorkloadSpec(name="long-context", rate_per_s=8, duration_s=20))
    fleet = OfflineFleet()
    one = simulate(requests, fleet)
    two = simulate(requests, fleet, replicas=2)
    random = simulate(requests, fleet, {"routing_strategy": "RANDOM"})
    assert two.requests == sum(two.outcomes.values()) == len(requests)
    # Each replica knows only its own half of the traffic, yet places alike.
    assert random.hit_rate + 0.2 < two.hit_rate <= one.hit_rate + 0.02


def test_cost_is_measured_step_by_step():
    cost = measure_cost(PrefixIndexOptions(iterations=50), 512, 7)
    assert cost.block_bytes == 512 and cost.hosts == 7
    steps = (cost.hash_us, cost.lookup_us, cost.record_us, cost.popularity_us, cost.queue_us)
    assert all(step > 0 for step in (*steps, cost.decide_us))
    assert cost.lookup_insert_us == sum(steps)


def test_the_report_is_rendered_from_the_stored_data(tmp_path):
    options = PrefixIndexOptions(
        iterations=20, block_sizes=(256, 512), hosts=(7,), seeds=(1,), quality_duration_s=5,
        out_dir=tmp_path,
    )  # fmt: skip
    data = run(options)
    stored = json.loads((tmp_path / "prefix-index.json").read_text())
    assert stored == json.loads(json.dumps(data))
    text = (tmp_path / "prefix-index.md").read_text()
    assert text == render(stored)
    assert "| 512 | 7 |" in text and "ring_hash" in text and "MiB" in text
