"""The engine model on a virtual clock: calibration, batching, queueing, KV blocks."""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.sim.cache import PrefixCache
from extproc.sim.engine import Engine, EngineConfig, EngineRequest

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
PROMPT_8K = "p" * (8000 * CHARS_PER_TOKEN)
# The calibration targets (engine.py's docstring), in seconds.
UNCACHED_8K_TTFT_S = 0.270
CACHED_8K_TTFT_S = 0.060
MAX_STEPS = 100_000


def text(tokens: int, letter: str = "p") -> str:
    return letter * (tokens * CHARS_PER_TOKEN)


def engine(capacity_blocks: int = 10_000, **config: object) -> Engine:
    return Engine(EngineConfig(**config), PrefixCache(capacity_blocks))  # type: ignore[arg-type]


@dataclass
class Run:
    """What a virtual-time run saw."""

    submitted_at: list[float] = field(default_factory=list)
    first_token_at: dict[int, float] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)
    requests: list[EngineRequest] = field(default_factory=list)
    max_waiting: int = 0
    end: float = 0.0

    def ttft(self, index: int) -> float:
        return self.first_token_at[index] - self.submitted_at[index]


def simulate(eng: Engine, arrivals: list[tuple[float, str, int]]) -> Run:
    """Drive `eng` as the server does, but on a virtual clock; arrivals sorted by time."""
    run = Run()
    pending = list(arrivals)
    index_of: dict[int, int] = {}
    now = 0.0
    for _ in range(MAX_STEPS):
        while pending and pending[0][0] <= now:
            at, prompt, max_tokens = pending.pop(0)
            request = eng.submit(prompt, max_tokens, at)
            index_of[id(request)] = len(run.requests)
            run.requests.append(request)
            run.submitted_at.append(at)
        batch = eng.schedule(now)
        run.max_waiting = max(run.max_waiting, eng.num_waiting)
        if batch is None:
            wakeups = [pending[0][0]] if pending else []
            if (ready_at := eng.next_ready_at()) is not None:
                wakeups.append(ready_at)
            if not wakeups:
                run.end = now
                return run
            now = max(now, min(wakeups))
            continue
        now = batch.ends_at
        for request in eng.complete(batch):
            index = index_of[id(request)]
            if request.output_tokens == 1:
                run.first_token_at[index] = now
            if request.finished:
                run.finished_at[index] = now
    raise AssertionError("simulation did not finish")


def within(value: float, target: float, tolerance: float = 0.10) -> bool:
    return abs(value - target) <= tolerance * target


def test_calibration_uncached_and_cached_8k_prompt_on_an_idle_instance() -> None:
    eng = engine()
    arrivals = [(0.0, PROMPT_8K, 4), (10.0, PROMPT_8K, 4)]
    run = simulate(eng, arrivals)
    assert within(run.ttft(0), UNCACHED_8K_TTFT_S)
    assert within(run.ttft(1), CACHED_8K_TTFT_S)
    # vLLM recomputes the last block of a fully cached prompt.
    assert run.requests[1].hit_tokens == 8000 - BLOCK_TOKENS


def test_inter_token_latency_is_one_decode_step() -> None:
    config = EngineConfig()
    arrivals = [(0.0, "hello", 11)]
    run = simulate(engine(), arrivals)
    itl = (run.finished_at[0] - run.first_token_at[0]) / 10
    expected = (config.step_overhead_ms + config.decode_ms_per_token) / 1000
    # Plus a few microseconds of attention over a context of 2 + 1..10 tokens.
    assert itl == pytest.approx(expected, rel=1e-3)


def test_decode_steps_slow_down_as_the_batch_and_its_context_grow() -> None:
    config = EngineConfig()
    one = simulate(engine(), [(0.0, PROMPT_8K, 11)])
    many = simulate(engine(), [(0.0, PROMPT_8K, 11)] + [(0.0, text(8000, "q"), 11)] * 63)
    itl_one = (one.finished_at[0] - one.first_token_at[0]) / 10
    # The last to start decodes while all the others decode too (their prefills are done).
    itl_many = min(many.finished_at[i] - many.first_token_at[i] for i in range(64)) / 10
    # 64 sequences of ~8k tokens read ~512k tokens of KV per step: ~10 ms more than one.
    extra_ms = config.attention_ms_per_kv_token * 63 * 8005
    assert itl_many - itl_one == pytest.approx(extra_ms / 1000, rel=0.1)
    assert itl_one == pytest.approx(0.030 + 0.16e-3, rel=0.01)


def test_an_instance_offered_more_than_its_decode_throughput_queues() -> None:
    # One cached 8k prompt asked 60 times a second for 64 tokens each: the batch grows until
    # the steps (30 ms + 0.16 ms per sequence) serve fewer requests than arrive.
    config = EngineConfig(max_num_seqs=64)
    arrivals = [(i / 60, PROMPT_8K + f"q{i:04d}", 64) for i in range(240)]
    run = simulate(engine(**config.__dict__), arrivals)
    assert run.max_waiting > 20
    assert run.ttft(239) > 10 * run.ttft(1)


@settings(max_examples=30, deadline=None)
@given(scale=st.floats(min_value=0.01, max_value=10))
def test_time_scale_scales_ttft_linearly(scale: float) -> None:
    # Uncached, then cached: the second arrives after the first is done, in both runs.
    base = simulate(engine(), [(0.0, PROMPT_8K, 2), (5.0, PROMPT_8K, 2)])
    scaled = simulate(engine(time_scale=scale), [(0.0, PROMPT_8K, 2), (5.0 * scale, PROMPT_8K, 2)])
    for index in (0, 1):
        assert scaled.ttft(index) == pytest.approx(base.ttft(index) * scale)


def test_two_concurrent_requests_finish_sooner_than_twice_one() -> None:
    one = simulate(engine(), [(0.0, text(2000, "a"), 32)])
    two = simulate(engine(), [(0.0, text(2000, "a"), 32), (0.0, text(2000, "b"), 32)])
    assert two.end < 2 * one.end
    # Both prompts fit one step's budget, so they even share their first step.
    assert two.first_token_at[0] == two.first_token_at[1]


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    config = EngineConfig(max_batched_tokens=1000, request_overhead_ms=0)
    run = simulate(Engine(config, PrefixCache(1000)), [(0.0, text(2500), 1)])
    # 1000 + 1000 + 500 tokens: three steps before the first token.
    expected = 2 * config.step_seconds(1000) + config.step_seconds(500)
    assert run.first_token_at[0] == pytest.approx(expected)


def test_requests_beyond_max_num_seqs_wait_and_their_ttft_grows() -> None:
    arrivals = [(0.0, text(100, letter), 20) for letter in "abcdef"]
    run = simulate(engine(max_num_seqs=2), arrivals)
    assert run.max_waiting == 4
    ttfts = [run.ttft(index) for index in range(6)]
    assert ttfts[0] == ttfts[1] < ttfts[2] == ttfts[3] < ttfts[4] == ttfts[5]


def test_requests_beyond_kv_capacity_wait_for_blocks() -> None:
    # Each request needs 7 blocks (100 prompt + 12 output tokens); 16 fit two at once.
    arrivals = [(0.0, text(100, letter), 12) for letter in "abcd"]
    eng = engine(capacity_blocks=16)
    run = simulate(eng, arrivals)
    assert run.max_waiting == 2
    assert run.ttft(2) > run.ttft(1)
    assert eng.num_running == eng.num_waiting == 0
    assert eng.cache.blocks_referenced == 0


def test_queueing_grows_ttft_under_a_burst_of_long_prompts() -> None:
    arrivals = [(0.0, text(8000, chr(ord("a") + i)), 8) for i in range(8)]
    run = simulate(engine(), arrivals)
    ttfts = [run.ttft(index) for index in range(8)]
    assert ttfts == sorted(ttfts)
    assert run.max_waiting > 0
    assert ttfts[-1] > 6 * UNCACHED_8K_TTFT_S


def test_a_request_that_can_never_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="KV blocks"):
        engine(capacity_blocks=4).submit(text(100), 1, 0.0)


def test_abort_releases_blocks_and_slot() -> None:
    eng = engine(capacity_blocks=100, max_num_seqs=1, request_overhead_ms=0)
    first = eng.submit(text(64), 100, 0.0)
    second = eng.submit(text(64, "q"), 100, 0.0)
    batch = eng.schedule(0.0)
    assert batch is not None
    assert (eng.num_running, eng.num_waiting) == (1, 1)
    held = eng.cache.blocks_referenced
    assert held == -(-(64 + 100) // BLOCK_TOKENS)

    eng.abort(first)  # mid-step, as a client abort lands
    assert eng.complete(batch) == []
    assert first.state == "aborted"
    assert eng.cache.blocks_referenced == 0
    # Its prompt blocks stay cached for later requests.
    assert eng.cache.blocks_used == 4

    batch = eng.schedule(batch.ends_at)
    assert batch is not None and batch.admitted == (second,)
    eng.abort(second)
    eng.abort(second)  # idempotent
    eng.complete(batch)
    assert eng.num_running == eng.num_waiting == 0
    assert eng.kv_usage() == 0


def test_a_queued_request_can_be_aborted_before_it_runs() -> None:
    eng = engine()
    request = eng.submit("x", 1, 0.0)
    eng.abort(request)
    assert eng.schedule(1.0) is None
    assert eng.next_ready_at() is None


def test_kv_usage_counts_held_blocks_only() -> None:
    eng = engine(capacity_blocks=100, request_overhead_ms=0)
    eng.submit(text(64), 16, 0.0)
    batch = eng.schedule(0.0)
    assert batch is not None
    assert eng.kv_usage() == 5 / 100  # 4 prompt blocks and 1 for the output
    eng.complete(batch)
    while batch := eng.schedule(batch.ends_at):
        eng.complete(batch)
    assert eng.kv_usage() == 0
    assert eng.cache.blocks_used == 4


def test_schedule_and_complete_must_alternate() -> None:
    eng = engine(request_overhead_ms=0)
    eng.submit("x", 2, 0.0)
    batch = eng.schedule(0.0)
    assert batch is not None
    with pytest.raises(RuntimeError):
        eng.schedule(0.0)
    eng.complete(batch)
    with pytest.raises(RuntimeError):
        eng.complete(batch)


@pytest.mark.parametrize(
    "field_name",
    [
        "prefill_ms_per_token",
        "decode_ms_per_token",
        "step_overhead_ms",
        "attention_ms_per_kv_token",
        "time_scale",
    ],
)
def test_config_rejects_negative_durations_by_name(field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        EngineConfig(**{field_name: -1.0})  # type: ignore[arg-type]


@pytest.mark.parametrize("field_name", ["max_batched_tokens", "max_num_seqs"])
def test_config_rejects_non_positive_counts_by_name(field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        EngineConfig(**{field_name: 0})  # type: ignore[arg-type]


# Prompts over a tiny alphabet of whole blocks, so prefixes are often shared.
block_prompts = st.lists(st.sampled_from("ab"), min_size=0, max_size=6).map(
    lambda letters: "".join(letter * BLOCK_CHARS for letter in letters) + "tail"
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), block_prompts, st.integers(1, 20)),
        st.tuples(st.just("step"), st.just(""), st.just(0)),
        st.tuples(st.just("abort"), st.just(""), st.integers(0, 30)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(min_value=9, max_value=40),
    max_num_seqs=st.integers(min_value=1, max_value=4),
    budget=st.integers(min_value=1, max_value=200),
    ops=operations,
)
def test_held_blocks_are_never_evicted_and_hits_are_whole_blocks(
    capacity: int, max_num_seqs: int, budget: int, ops: list[tuple[str, str, int]]
) -> None:
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_batched_tokens=budget, request_overhead_ms=0
    )
    eng = Engine(config, PrefixCache(capacity))
    requests: list[EngineRequest] = []
    now = 0.0
    for kind, prompt, number in ops:
        if kind == "submit":
            requests.append(eng.submit(prompt, number, now))
        elif kind == "abort" and requests:
            eng.abort(requests[number % len(requests)])
        elif kind == "step" and (batch := eng.schedule(now)) is not None:
            now = batch.ends_at
            eng.complete(batch)

        running = [request for request in requests if request.state == "running"]
        assert eng.num_running == len(running) <= max_num_seqs
        for request in running:
            hashes = request.block_hashes
            assert eng.cache.cached_prefix_blocks(hashes) == len(hashes)
        # Running requests sharing a prefix hold its blocks once between them.
        shared = set().union(*(request.block_hashes for request in running))
        private = sum(request.private_blocks for request in running)
        assert eng.cache.blocks_referenced == len(shared) + private
        assert eng.cache.blocks_used <= capacity
        for request in requests:
            assert request.hit_tokens % BLOCK_TOKENS == 0
            assert 0 <= request.hit_tokens < max(1, request.prompt_tokens)


@settings(max_examples=50, deadline=None)
@given(prompts=st.lists(block_prompts, min_size=1, max_size=8))
def test_every_request_finishes_with_all_its_tokens(prompts: list[str]) -> None:
    arrivals = [(0.01 * index, prompt, 1 + index % 3) for index, prompt in enumerate(prompts)]
    eng = engine(capacity_blocks=12, max_num_seqs=2, max_batched_tokens=40)
    run = simulate(eng, arrivals)
    assert all(request.finished for request in run.requests)
    for request, (_, _, max_tokens) in zip(run.requests, arrivals, strict=True):
        assert request.output_tokens == max_tokens
    assert eng.cache.blocks_referenced == 0
