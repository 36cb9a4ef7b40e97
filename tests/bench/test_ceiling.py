"""The hit-rate ceiling: one unbounded cache's replay, the bound with an instance cap, and
that both bound what the stored fleet runs measured."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from extproc.bench import ceiling
from extproc.bench.offline import SESSION_HASH, OfflineFleet, simulate
from extproc.bench.served import prompt_of
from extproc.bench.workloads import BenchRequest, WorkloadSpec, generate

BENCHMARKS = Path(__file__).parents[2] / "docs" / "benchmarks"
BLOCK_CHARS = 16 * 4  # the simulator's default block: 16 tokens of 4 characters


def _request(group: str, system: str, question: str, index: int = 0) -> BenchRequest:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": "m", "messages": messages, "max_tokens": 4, "stream": True}
    return BenchRequest(float(index), body, {}, group, len(system + question) // 4)


def _documents(sizes: dict[str, int], preamble: str = "") -> list[BenchRequest]:
    """``sizes[group]`` requests per group, each a document of 20 blocks and a question."""
    requests = []
    for group, count in sizes.items():
        document = preamble + (group + ": ") * (20 * BLOCK_CHARS // (len(group) + 2))
        for _ in range(count):
            requests.append(_request(group, document, f"Q{len(requests)}: why?"))
    return requests


def test_an_unbounded_replay_of_two_identical_prompts_hits_the_second():
    twice = [_request("a", "x" * 10 * BLOCK_CHARS, "same question")] * 2
    totals = ceiling.replay(twice, ceiling.unbounded_cache(16, 4))
    prompt_tokens = totals.query_tokens // 2
    # The second prompt finds every full block of the first: all but its partial last block.
    assert totals.hit_tokens == prompt_tokens // 16 * 16 > 0
    found = ceiling.ceiling(twice)
    assert found.hit_rate == totals.hit_tokens / totals.query_tokens


def test_the_ceiling_is_the_offline_model_with_one_instance_that_never_evicts():
    requests = generate(WorkloadSpec(name="conversations", rate_per_s=4, duration_s=20))
    one = OfflineFleet(instances=1, capacity_blocks=10**9)
    assert ceiling.ceiling(requests).hit_rate == simulate(requests, one, path=SESSION_HASH).hit_rate


def test_the_instance_limit_is_exact():
    assert ceiling.per_instance_limit(195, 0.2) == 39  # 20% of 195, not 38.99...
    assert ceiling.per_instance_limit(669, 0.2) == 133
    assert ceiling.per_instance_limit(3, 0.2) == 1  # never below one request


def test_the_capped_bound_is_below_the_ceiling_when_a_group_carries_more_than_the_cap():
    # 10 requests, at most 2 per instance: doc-a's 5 need 3 instances, so its document is
    # prefilled twice more than the replay's one cold miss.
    requests = _documents({"doc-a": 5, "doc-b": 2, "doc-c": 2, "doc-d": 1})
    found = ceiling.ceiling(requests)
    assert (found.busiest_group, found.busiest_share, found.per_instance_limit) == ("doc-a", 0.5, 2)
    assert found.over_cap and found.capped_hit_rate < found.hit_rate
    assert found.capped_extra_misses == 2 * _shared_blocks(requests[:5]) * 16


def _shared_blocks(requests: list[BenchRequest]) -> int:
    # The prompts differ from the question's number on: "...user\nQ0: why?", "...Q1: ...".
    first = prompt_of(requests[0])
    return len(first[: first.rindex("Q") + 1]) // BLOCK_CHARS


def test_blocks_other_groups_also_bring_cost_no_extra_misses():
    preamble = "p" * 8 * BLOCK_CHARS  # every document starts with the same 8 blocks
    alone = ceiling.ceiling(_documents({"doc-a": 5, "doc-b": 2, "doc-c": 3}))
    shared = ceiling.ceiling(_documents({"doc-a": 5, "doc-b": 2, "doc-c": 3}, preamble))
    # The preamble's blocks (and the chat template's start before them) could come from
    # doc-b or doc-c: only doc-a's own blocks count, the same number as without it.
    assert shared.capped_extra_misses == alone.capped_extra_misses > 0


def test_the_capped_bound_is_the_ceiling_when_no_group_carries_more_than_the_cap():
    found = ceiling.ceiling(_documents({f"doc-{i}": 2 for i in range(5)}))
    assert not found.over_cap and found.busiest_share == 0.2
    assert found.capped_extra_misses == 0 and found.capped_hit_rate == found.hit_rate


def _stored_fleet_runs() -> list[Path]:
    return [
        path
        for path in sorted(BENCHMARKS.glob("*.json"))
        if json.loads(path.read_text()).get("kind") == "fleet"
    ]


def _measured(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["results"] if not r.get("skipped")]


@pytest.mark.parametrize("path", _stored_fleet_runs(), ids=lambda p: p.stem)
def test_the_ceilings_bound_every_hit_rate_a_stored_run_measured(path):
    run = json.loads(path.read_text())
    found = ceiling.stored_ceiling(run)
    assert found is not None, f"{path.name}: its workload no longer generates its requests"
    for result in _measured(run):
        assert result["hit_rate"] <= found.hit_rate, result["path"]
        if max(result["shares"].values()) <= ceiling.SHARE_CAP:
            assert result["hit_rate"] <= found.capped_hit_rate, result["path"]
    # The closed loop serves the schedule's first requests, in order, without arrival times.
    loops = [(r["path"], r["closed_loop"]) for r in _measured(run) if r.get("closed_loop")]
    counts = {loop["completed"] + loop["failed"] for _, loop in loops}
    schedule = generate(WorkloadSpec(**run["workload"])) if loops else []
    ceilings = {n: ceiling.replay(schedule[:n], ceiling.unbounded_cache(16, 4)) for n in counts}
    for name, loop in loops:
        totals = ceilings[loop["completed"] + loop["failed"]]
        assert loop["hit_rate"] <= totals.hit_tokens / totals.query_tokens, name


def test_a_stored_run_whose_schedule_changed_has_no_ceiling():
    spec = WorkloadSpec(name="long-context", rate_per_s=8, duration_s=5)
    run = {"workload": asdict(spec), "simulator": {"args": []}, "requests": len(generate(spec))}
    assert ceiling.stored_ceiling(run) == ceiling.ceiling(generate(spec))
    assert ceiling.stored_ceiling(run | {"requests": run["requests"] + 1}) is None
    assert ceiling.stored_ceiling({"results": []}) is None


def test_a_stored_runs_block_size_is_the_one_its_instances_ran():
    spec = WorkloadSpec(name="long-context", rate_per_s=8, duration_s=5)
    run = {
        "workload": asdict(spec),
        "simulator": {"args": ["--timing", "model", "--block-size", "32"]},
        "requests": len(generate(spec)),
    }
    assert ceiling.stored_ceiling(run) == ceiling.ceiling(generate(spec), block_size_tokens=32)
