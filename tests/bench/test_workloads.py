from collections import Counter, defaultdict
from dataclasses import fields, replace
from itertools import pairwise
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.bench.workloads import (
    CHARS_PER_TOKEN,
    SESSION_HEADER,
    TENANT_BODY_FIELD,
    TENANT_HEADER,
    WORKLOAD_PARAMETERS,
    WORKLOADS,
    BenchRequest,
    WorkloadName,
    WorkloadSpec,
    describe,
    generate,
    zipf_share,
)

NAMES = get_args(WorkloadName)
DOCUMENT_WORKLOADS = ("long-context", "long-context-short-prefix", "hot-spot")


def small(name: str, **overrides) -> WorkloadSpec:
    """A spec with short texts, so the statistical tests can afford thousands of requests."""
    shape = dict(
        doc_tokens=64,
        shared_preamble_tokens=32,
        question_tokens=8,
        chat_system_tokens=16,
        tenant_system_tokens=64,
        tenant_context_tokens=16,
        user_turn_tokens_mean=20.0,
        assistant_turn_tokens_mean=40.0,
        turn_tokens_max=200,
    )
    shape.update(overrides)
    return WorkloadSpec(name, **shape)


def system_text(request: BenchRequest) -> str:
    return request.body["messages"][0]["content"]


def by_group(requests: list[BenchRequest]) -> dict[str, list[BenchRequest]]:
    groups = defaultdict(list)
    for request in requests:
        groups[request.group].append(request)
    return groups


def test_every_name_has_a_generator_and_a_parameter_list():
    assert set(WORKLOADS) == set(NAMES) == set(WORKLOAD_PARAMETERS)


@pytest.mark.parametrize("name", NAMES)
def test_same_spec_gives_the_same_schedule_and_another_seed_another(name):
    spec = small(name, max_requests=200, duration_s=None)
    first = generate(spec)
    assert first == generate(spec)
    assert first != generate(replace(spec, seed=2))


@pytest.mark.parametrize("name", NAMES)
def test_requests_are_sorted_well_formed_chat_bodies(name):
    requests = generate(small(name, duration_s=30.0), model="m")
    assert requests
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    for request in requests:
        assert request.body["model"] == "m"
        assert request.body["stream"] is True
        assert request.body["max_tokens"] >= 1
        assert request.headers[SESSION_HEADER] == request.group
        messages = request.body["messages"]
        assert messages[0]["role"] == "system"
        assert messages[-1]["role"] == "user"
        chars = sum(len(m["content"]) for m in messages)
        assert request.prompt_tokens == chars // CHARS_PER_TOKEN


@pytest.mark.parametrize("name", [*DOCUMENT_WORKLOADS, "multi-tenant"])
def test_poisson_inter_arrival_mean_matches_the_rate(name):
    requests = generate(small(name, rate_per_s=50.0, duration_s=None, max_requests=3000))
    assert len(requests) == 3000
    gaps = [b.at_s - a.at_s for a, b in pairwise(requests)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.1)


def test_conversations_offer_about_rate_per_s_requests_overall():
    spec = small("conversations", rate_per_s=2.0, duration_s=2000.0)
    assert len(generate(spec)) / 2000.0 == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize("name", NAMES)
def test_bounds_are_respected_and_a_cut_does_not_change_the_schedule(name):
    by_duration = generate(small(name, duration_s=20.0))
    assert by_duration
    assert all(r.at_s <= 20.0 for r in by_duration)
    by_count = generate(small(name, duration_s=None, max_requests=50))
    assert len(by_count) == 50
    both = generate(small(name, duration_s=5.0, max_requests=10_000))
    assert all(r.at_s <= 5.0 for r in both)
    # Where a run is cut does not change what comes before the cut.
    long_run = generate(small(name, duration_s=1000.0))
    assert by_count == long_run[:50]
    assert both == [r for r in long_run if r.at_s <= 5.0]


def test_a_spec_needs_a_bound_a_positive_rate_and_a_known_name():
    with pytest.raises(ValueError, match="duration_s or max_requests"):
        WorkloadSpec("long-context", duration_s=None)
    with pytest.raises(ValueError, match="rate_per_s"):
        WorkloadSpec("long-context", rate_per_s=0.0)
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec("nope")  # type: ignore[arg-type]


def test_long_context_documents_are_whole_identical_and_differ_at_the_start():
    requests = generate(WorkloadSpec("long-context", duration_s=None, max_requests=300))
    documents = {}
    for request in requests:
        document = documents.setdefault(request.group, system_text(request))
        assert system_text(request) == document  # byte-identical prefix within a document
        assert len(document) == 8192 * CHARS_PER_TOKEN
    assert len(documents) > 20
    starts = [document[:8] for document in documents.values()]
    assert len(set(starts)) == len(starts)  # different documents differ within 8 characters
    questions = [r.body["messages"][-1]["content"] for r in requests]
    assert len(set(questions)) == len(questions)  # no two requests are identical
    assert all(len(q) == 40 * CHARS_PER_TOKEN for q in questions)
    assert all(r.body["max_tokens"] == 64 for r in requests)


def test_zipf_gives_the_most_popular_document_its_expected_share():
    spec = small("long-context", duration_s=None, max_requests=5000)
    counts = Counter(r.group for r in generate(spec))
    assert counts.most_common(1)[0][0] == "doc-0"
    expected = zipf_share(1, spec.documents, spec.zipf_s)
    assert counts["doc-0"] / 5000 == pytest.approx(expected, rel=0.1)
    assert counts["doc-1"] / 5000 == pytest.approx(zipf_share(2, 40, 1.1), rel=0.15)


def test_short_prefix_documents_share_their_first_2k_tokens_then_differ():
    requests = generate(
        WorkloadSpec("long-context-short-prefix", duration_s=None, max_requests=200)
    )
    documents = {r.group: system_text(r) for r in requests}
    assert len(documents) > 20
    shared_chars = 2048 * CHARS_PER_TOKEN
    assert len({document[:shared_chars] for document in documents.values()}) == 1
    after = [document[shared_chars : shared_chars + 8] for document in documents.values()]
    assert len(set(after)) == len(after)
    assert all(len(document) == 8192 * CHARS_PER_TOKEN for document in documents.values())
    # The router's key is "system\n" + text cut at PrefixLength: one key for all documents.
    assert len({("system\n" + d)[:shared_chars] for d in documents.values()}) == 1


def test_document_workloads_share_arrivals_for_one_seed():
    plain = generate(small("long-context", max_requests=100, duration_s=None))
    short = generate(small("long-context-short-prefix", max_requests=100, duration_s=None))
    assert [(r.at_s, r.group) for r in plain] == [(r.at_s, r.group) for r in short]


def test_hot_spot_sends_the_configured_share_to_one_document():
    requests = generate(small("hot-spot", duration_s=None, max_requests=4000))
    counts = Counter(r.group for r in requests)
    assert counts["doc-0"] / 4000 == pytest.approx(0.5, abs=0.03)
    hotter = generate(small("hot-spot", hot_share=0.8, duration_s=None, max_requests=4000))
    assert Counter(r.group for r in hotter)["doc-0"] / 4000 == pytest.approx(0.8, abs=0.03)


def test_conversations_resend_the_history_and_grow_turn_by_turn():
    spec = small("conversations", duration_s=600.0)
    conversations = by_group(generate(spec))
    assert len(conversations) > 100
    system_prompts = set()
    for turns in conversations.values():
        assert 1 <= len(turns) <= spec.conversation_turns_max
        for number, request in enumerate(turns, start=1):
            messages = request.body["messages"]
            system_prompts.add(messages[0]["content"])
            assert len(messages) == 2 * number
            roles = [m["role"] for m in messages[1:]]
            assert roles == ["user", "assistant"] * (number - 1) + ["user"]
        for previous, following in pairwise(turns):
            earlier, later = previous.body["messages"], following.body["messages"]
            assert later[: len(earlier)] == earlier  # the prefix property
            # The reply resent in history is as long as the previous turn allowed.
            reply = later[len(earlier)]["content"]
            assert len(reply) == previous.body["max_tokens"] * CHARS_PER_TOKEN
            assert following.at_s > previous.at_s
    assert len(system_prompts) == 1


def test_conversation_shapes_follow_the_sharegpt_like_targets():
    # A long window and a long cut-off so few conversations are truncated by the end.
    spec = small(
        "conversations",
        rate_per_s=4.0,
        duration_s=3000.0,
        user_turn_tokens_mean=80.0,
        assistant_turn_tokens_mean=250.0,
        turn_tokens_max=2048,
    )
    conversations = by_group(generate(spec))
    turn_counts = [len(turns) for turns in conversations.values()]
    assert max(turn_counts) <= 12
    assert sum(turn_counts) / len(turn_counts) == pytest.approx(3.5, rel=0.1)
    last_turns = [turns[-1].body["messages"] for turns in conversations.values()]
    user = [len(m["content"]) / 4 for ms in last_turns for m in ms if m["role"] == "user"]
    replies = [t.body["max_tokens"] for turns in conversations.values() for t in turns]
    # Lognormal means, slightly pulled down by the cap and rounding.
    assert sum(user) / len(user) == pytest.approx(80, rel=0.15)
    assert sum(replies) / len(replies) == pytest.approx(250, rel=0.15)


def test_multi_tenant_salts_by_header_or_body_and_shares_the_system_prompt():
    spec = WorkloadSpec("multi-tenant", duration_s=None, max_requests=400)
    requests = generate(spec)
    header_tenants, body_tenants = set(), set()
    for request in requests:
        in_header = request.headers.get(TENANT_HEADER)
        in_body = request.body.get(TENANT_BODY_FIELD)
        assert (in_header is None) != (in_body is None)  # exactly one way
        assert (in_header or in_body) == request.group
        (header_tenants if in_header else body_tenants).add(request.group)
    assert len(header_tenants) == 24
    assert body_tenants == {f"tenant-{n}" for n in range(24, 32)}
    systems = {r.group: system_text(r) for r in requests}
    assert len(systems) == 32
    shared_chars = 2048 * CHARS_PER_TOKEN
    assert len({s[:shared_chars] for s in systems.values()}) == 1  # the shared prompt
    contexts = {s[shared_chars:] for s in systems.values()}
    assert len(contexts) == 32  # then each tenant's own context
    assert all(len(s) >= (2048 + 6144) * CHARS_PER_TOKEN for s in systems.values())
    # More than three simulated instances' caches (64k tokens each) hold: it cannot all fit.
    assert sum(len(s) for s in systems.values()) // CHARS_PER_TOKEN > 3 * 64_000


@pytest.mark.parametrize("name", NAMES)
def test_describe_lists_every_parameter_the_workload_uses(name):
    spec = small(name, max_requests=10)
    text = describe(spec)
    assert f"**{name}**" in text
    for parameter in WORKLOAD_PARAMETERS[name]:
        assert f"`{parameter}`={getattr(spec, parameter)}" in text
    assert "\n" not in text  # one paragraph


def test_every_spec_field_is_used_by_some_workload():
    used = {parameter for parameters in WORKLOAD_PARAMETERS.values() for parameter in parameters}
    assert used == {f.name for f in fields(WorkloadSpec)} - {"name"}


def test_describe_of_the_short_prefix_variant_names_the_collapse():
    assert "one key" in describe(WorkloadSpec("long-context-short-prefix"))


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    seed=st.integers(0, 10_000),
    rate=st.floats(0.5, 50.0),
    duration=st.one_of(st.none(), st.floats(0.5, 30.0)),
    max_requests=st.integers(1, 60),
)
def test_any_small_spec_is_sorted_and_bounded(name, seed, rate, duration, max_requests):
    spec = small(name, seed=seed, rate_per_s=rate, duration_s=duration, max_requests=max_requests)
    requests = generate(spec)
    assert len(requests) <= max_requests
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    assert all(r.at_s > 0 for r in requests)
    if duration is not None:
        assert all(r.at_s <= duration for r in requests)
