"""Benchmark workload generators: seeded, open-loop request schedules for prefix routing.

Each workload is a list of ``BenchRequest`` sorted by arrival time. Arrivals are open loop
(a Poisson process that does not wait for answers), so a slow router shows up as latency
rather than as a lower offered load. Prompt text is built from a seeded vocabulary at about
4 characters per token: equal prefixes are byte-identical, and different documents differ
in their first characters, because a prefix cache (and the router's key) looks at the start.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal, get_args

from extproc.sim.responses import reply_text

CHARS_PER_TOKEN = 4
SESSION_HEADER = "x-session-id"  # the ring_hash baseline hashes on it
TENANT_HEADER = "x-prefix-aware-id"
TENANT_BODY_FIELD = "prompt_cache_key"
_VOCABULARY_SIZE = 4096

WorkloadName = Literal[
    "long-context", "long-context-short-prefix", "conversations", "multi-tenant", "hot-spot"
]


@dataclass(frozen=True)
class BenchRequest:
    at_s: float  # open-loop arrival time, seconds from the start
    body: dict[str, Any]  # an OpenAI /v1/chat/completions body
    headers: dict[str, str]
    group: str  # the shared prefix / conversation / tenant it belongs to
    prompt_tokens: int  # approximate, 4 characters per token
    # A later turn of a conversation: the client sends it this long after the reply to the
    # group's previous request has arrived (it resends that reply), not at ``at_s``, which
    # is then only its order. None: sent at ``at_s``, whatever came before.
    think_s: float | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Each workload reads only the fields in ``WORKLOAD_PARAMETERS``."""

    name: WorkloadName
    seed: int = 1
    rate_per_s: float = 4.0  # mean request rate of the open-loop Poisson arrivals
    duration_s: float | None = 60.0  # no arrival after this
    max_requests: int | None = None  # whichever bound is hit first; at least one is set
    # Document workloads (long-context, long-context-short-prefix, hot-spot).
    documents: int = 40
    doc_tokens: int = 8192
    zipf_s: float = 1.1  # popularity of the document of rank k is proportional to k**-s
    shared_preamble_tokens: int = 2048  # short-prefix: identical start of every document
    hot_share: float = 0.5  # hot-spot: share of traffic to the one hot document
    # Document and multi-tenant requests: the varying question and the answer length.
    question_tokens: int = 40
    output_tokens: int = 64
    # Conversations: ShareGPT-like shapes, see _conversations.
    conversation_turns_mean: float = 3.5
    conversation_turns_max: int = 12
    chat_system_tokens: int = 200
    user_turn_tokens_mean: float = 80.0
    assistant_turn_tokens_mean: float = 250.0
    turn_tokens_sigma: float = 1.0  # lognormal shape of turn lengths; 1.0 is heavy-tailed
    turn_tokens_max: int = 2048
    think_time_mean_s: float = 5.0  # from the reply to turn k to the client sending turn k+1
    # Multi-tenant: 32 tenants of ~8k tokens each, ~200k tokens in all, three times what one
    # simulated instance of the fleet benchmark caches (64k tokens), a third of the fleet's.
    tenants: int = 32
    tenant_system_tokens: int = 2048  # shared by all tenants
    tenant_context_tokens: int = 6144  # tenant-specific, after the shared prompt
    tenants_with_body_key: int = 8  # the last ones send prompt_cache_key, not the header

    def __post_init__(self) -> None:
        if self.name not in get_args(WorkloadName):
            raise ValueError(f"unknown workload {self.name!r}")
        if self.duration_s is None and self.max_requests is None:
            raise ValueError("set duration_s or max_requests (or both)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be at least 1")
        if self.rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")


# --- text -----------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _vocabulary(seed: int) -> tuple[str, ...]:
    rng = random.Random(f"vocabulary:{seed}")
    letters = "abcdefghijklmnopqrstuvwxyz"
    return tuple(
        "".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(_VOCABULARY_SIZE)
    )


def _text(rng: random.Random, vocabulary: Sequence[str], tokens: int, lead: str = "") -> str:
    """Exactly ``tokens * 4`` characters: ``lead``, then seeded words."""
    chars = tokens * CHARS_PER_TOKEN
    parts = [lead] if lead else []
    text = lead
    while len(text) < chars:
        # About 6.5 characters per word and space: one batch usually suffices.
        parts.extend(rng.choices(vocabulary, k=(chars - len(text)) // 5 + 8))
        text = " ".join(parts)
    return text[:chars]


def _rng(spec: WorkloadSpec, purpose: str) -> random.Random:
    # String seeds hash with SHA-512, so streams are stable across processes and runs.
    # The name is left out on purpose: the document workloads then share arrival times
    # and document picks for one seed, and differ only in what they vary.
    return random.Random(f"{spec.seed}:{purpose}")


# --- arrivals and popularity ----------------------------------------------------------


def _poisson_arrivals(
    rng: random.Random, rate_per_s: float, duration_s: float | None, max_count: int | None
) -> Iterator[float]:
    at_s = 0.0
    count = 0
    while max_count is None or count < max_count:
        at_s += rng.expovariate(rate_per_s)
        if duration_s is not None and at_s > duration_s:
            return
        yield at_s
        count += 1


def _zipf_cum_weights(count: int, s: float) -> list[float]:
    cumulative, total = [], 0.0
    for rank in range(1, count + 1):
        total += rank**-s
        cumulative.append(total)
    return cumulative


def zipf_share(rank: int, count: int, s: float) -> float:
    """Expected traffic share of the item of 1-based ``rank`` among ``count`` (for analysis)."""
    return float(rank**-s / _zipf_cum_weights(count, s)[-1])


def _truncated_geometric_cum_weights(mean: float, maximum: int) -> list[float]:
    """Cumulative weights on 1..maximum of a geometric law whose truncated mean is ``mean``."""
    if maximum < 1 or not (1 <= mean < (maximum + 1) / 2 or mean == 1 == maximum):
        raise ValueError(f"a turn mean of {mean} needs 1 <= mean < (max + 1) / 2")

    def truncated_mean(p: float) -> float:
        weights = [(1 - p) ** (k - 1) for k in range(1, maximum + 1)]
        return sum(k * w for k, w in enumerate(weights, start=1)) / sum(weights)

    low, high = 1e-9, 1.0  # truncated_mean falls as p rises
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if truncated_mean(middle) > mean else (low, middle)
    p = (low + high) / 2
    cumulative, total = [], 0.0
    for k in range(1, maximum + 1):
        total += (1 - p) ** (k - 1)
        cumulative.append(total)
    return cumulative


def _lognormal_tokens(rng: random.Random, mean: float, sigma: float, maximum: int) -> int:
    # mu chosen so the (untruncated) lognormal has the requested mean.
    mu = math.log(mean) - sigma**2 / 2
    return max(1, min(maximum, round(rng.lognormvariate(mu, sigma))))


# --- requests -------------------------------------------------------------------------


def _request(
    at_s: float,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    group: str,
    extra_headers: dict[str, str] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> BenchRequest:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
    }
    body.update(extra_body or {})
    headers = {SESSION_HEADER: group, **(extra_headers or {})}
    prompt_chars = sum(len(message["content"]) for message in messages)
    return BenchRequest(at_s, body, headers, group, prompt_chars // CHARS_PER_TOKEN)


def _question(rng: random.Random, vocabulary: Sequence[str], tokens: int, index: int) -> str:
    # The index makes every question, and so every request, distinct.
    marker = f"Q{index}:"
    return _text(rng, vocabulary, max(tokens, len(marker) // CHARS_PER_TOKEN + 1), marker)


def _documents(spec: WorkloadSpec, preamble_tokens: int = 0) -> list[str]:
    """Documents of ``doc_tokens``; each starts with its own 8-hex tag, after any preamble."""
    if spec.documents < 1 or spec.doc_tokens < 3:
        raise ValueError("need documents >= 1 and doc_tokens >= 3")
    if not 0 <= preamble_tokens <= spec.doc_tokens - 3:
        raise ValueError("shared_preamble_tokens must leave at least 3 tokens per document")
    vocabulary = _vocabulary(spec.seed)
    tag_rng = random.Random(f"{spec.seed}:document-tags")
    tags = [f"{n:08x}" for n in tag_rng.sample(range(16**8), spec.documents)]
    preamble = ""
    if preamble_tokens:
        preamble_rng = random.Random(f"{spec.seed}:preamble")
        preamble = _text(preamble_rng, vocabulary, preamble_tokens, "Company policy.")
    own_tokens = spec.doc_tokens - preamble_tokens
    return [
        preamble + _text(random.Random(f"{spec.seed}:document:{i}"), vocabulary, own_tokens, tag)
        for i, tag in enumerate(tags)
    ]


def _document_requests(
    spec: WorkloadSpec,
    model: str,
    documents: list[str],
    pick_document: Callable[[random.Random], int],
) -> list[BenchRequest]:
    arrivals = _rng(spec, "arrivals")
    content = _rng(spec, "content")
    vocabulary = _vocabulary(spec.seed)
    requests = []
    for index, at_s in enumerate(
        _poisson_arrivals(arrivals, spec.rate_per_s, spec.duration_s, spec.max_requests)
    ):
        doc = pick_document(content)
        question = _question(content, vocabulary, spec.question_tokens, index)
        messages = [
            {"role": "system", "content": documents[doc]},
            {"role": "user", "content": question},
        ]
        requests.append(_request(at_s, model, messages, spec.output_tokens, f"doc-{doc}"))
    return requests


def _zipf_picker(count: int, s: float, first: int = 0) -> Callable[[random.Random], int]:
    population = range(first, first + count)
    cumulative = _zipf_cum_weights(count, s)
    return lambda rng: rng.choices(population, cum_weights=cumulative)[0]


def _long_context(spec: WorkloadSpec, model: str) -> list[BenchRequest]:
    picker = _zipf_picker(spec.documents, spec.zipf_s)
    return _document_requests(spec, model, _documents(spec), picker)


def _long_context_short_prefix(spec: WorkloadSpec, model: str) -> list[BenchRequest]:
    documents = _documents(spec, spec.shared_preamble_tokens)
    return _document_requests(spec, model, documents, _zipf_picker(spec.documents, spec.zipf_s))


def _hot_spot(spec: WorkloadSpec, model: str) -> list[BenchRequest]:
    if spec.documents < 2 or not 0 <= spec.hot_share <= 1:
        raise ValueError("hot-spot needs documents >= 2 and 0 <= hot_share <= 1")
    # Document 0 is hot; the rest keep a Zipf popularity among themselves.
    cold = _zipf_picker(spec.documents - 1, spec.zipf_s, first=1)

    def pick(rng: random.Random) -> int:
        return 0 if rng.random() < spec.hot_share else cold(rng)

    return _document_requests(spec, model, _documents(spec), pick)


def _conversations(spec: WorkloadSpec, model: str) -> list[BenchRequest]:
    """Multi-turn chats; each request resends the whole history plus a new user turn.

    Shapes are ShareGPT-like. ShareGPT averages 3.51 turns per conversation (94,145
    conversations, 330,239 turns, as tabulated in the LMSYS-Chat-1M paper, arXiv
    2309.11998). Turns: geometric truncated at 12, fitted to mean 3.5. Turn lengths:
    lognormal, user mean ~80 tokens, assistant mean ~250 tokens, sigma 1 (ShareGPT
    lengths are heavy-tailed), capped at 2048 tokens so a history stays bounded.
    """
    if spec.user_turn_tokens_mean <= 0 or spec.assistant_turn_tokens_mean <= 0:
        raise ValueError("turn token means must be positive")
    if spec.think_time_mean_s <= 0:
        raise ValueError("think_time_mean_s must be positive")
    turn_weights = _truncated_geometric_cum_weights(
        spec.conversation_turns_mean, spec.conversation_turns_max
    )
    turn_counts = range(1, spec.conversation_turns_max + 1)
    arrivals = _rng(spec, "arrivals")
    content = _rng(spec, "content")
    vocabulary = _vocabulary(spec.seed)
    system_rng = random.Random(f"{spec.seed}:chat-system")
    system = {
        "role": "system",
        "content": _text(system_rng, vocabulary, spec.chat_system_tokens, "You are helpful."),
    }

    def turn_tokens(mean: float) -> int:
        return _lognormal_tokens(content, mean, spec.turn_tokens_sigma, spec.turn_tokens_max)

    # Conversations start at rate / mean turns, so requests arrive at about rate_per_s.
    start_rate = spec.rate_per_s / spec.conversation_turns_mean
    requests: list[BenchRequest] = []
    unsettled: list[float] = []  # arrival times not yet known to precede every later one
    settled = 0
    for index, start_s in enumerate(_poisson_arrivals(arrivals, start_rate, spec.duration_s, None)):
        if spec.max_requests is not None:
            # Later conversations only add requests after start_s: once max_requests
            # arrivals precede it, the first max_requests of the schedule are final.
            while unsettled and unsettled[0] <= start_s:
                heapq.heappop(unsettled)
                settled += 1
            if settled >= spec.max_requests:
                break
        turns = arrivals.choices(turn_counts, cum_weights=turn_weights)[0]
        group = f"conv-{index}"
        history = [system]
        at_s = start_s
        think_s = None
        # The whole conversation is drawn even past duration_s, so the random streams
        # (and hence the schedule) do not depend on where the run is cut.
        for turn in range(turns):
            if turn:
                think_s = arrivals.expovariate(1 / spec.think_time_mean_s)
                at_s += think_s
            user_tokens = turn_tokens(spec.user_turn_tokens_mean)
            user = {"role": "user", "content": _text(content, vocabulary, user_tokens)}
            reply_tokens = turn_tokens(spec.assistant_turn_tokens_mean)
            messages = [*history, user]
            if spec.duration_s is None or at_s <= spec.duration_s:
                request = _request(at_s, model, messages, reply_tokens, group)
                requests.append(replace(request, think_s=think_s))
                heapq.heappush(unsettled, at_s)
            # The reply the client will resend: what the simulator generates for max_tokens
            # (deterministic, as at temperature 0), so its cached output blocks can hit.
            reply = {"role": "assistant", "content": reply_text(reply_tokens, CHARS_PER_TOKEN)}
            history = [*messages, reply]
    requests.sort(key=lambda request: request.at_s)
    return requests[: spec.max_requests] if spec.max_requests is not None else requests


def _multi_tenant(spec: WorkloadSpec, model: str) -> list[BenchRequest]:
    if spec.tenants < 1 or not 0 <= spec.tenants_with_body_key <= spec.tenants:
        raise ValueError("need tenants >= 1 and 0 <= tenants_with_body_key <= tenants")
    vocabulary = _vocabulary(spec.seed)
    shared_rng = random.Random(f"{spec.seed}:tenant-shared")
    shared = _text(shared_rng, vocabulary, spec.tenant_system_tokens, "Shared system prompt.")
    systems = [
        shared
        + "\n\n"
        + _text(
            random.Random(f"{spec.seed}:tenant:{i}"),
            vocabulary,
            spec.tenant_context_tokens,
            f"tenant-{i} context.",
        )
        for i in range(spec.tenants)
    ]
    first_body_key_tenant = spec.tenants - spec.tenants_with_body_key
    arrivals = _rng(spec, "arrivals")
    content = _rng(spec, "content")
    requests = []
    for index, at_s in enumerate(
        _poisson_arrivals(arrivals, spec.rate_per_s, spec.duration_s, spec.max_requests)
    ):
        tenant = content.randrange(spec.tenants)
        tenant_id = f"tenant-{tenant}"
        question = _question(content, vocabulary, spec.question_tokens, index)
        messages = [
            {"role": "system", "content": systems[tenant]},
            {"role": "user", "content": question},
        ]
        # Both ways a client can salt the key: the header, or the body field.
        if tenant >= first_body_key_tenant:
            salt = {"extra_body": {TENANT_BODY_FIELD: tenant_id}}
        else:
            salt = {"extra_headers": {TENANT_HEADER: tenant_id}}
        requests.append(_request(at_s, model, messages, spec.output_tokens, tenant_id, **salt))
    return requests


WORKLOADS: dict[WorkloadName, Callable[[WorkloadSpec, str], list[BenchRequest]]] = {
    "long-context": _long_context,
    "long-context-short-prefix": _long_context_short_prefix,
    "conversations": _conversations,
    "multi-tenant": _multi_tenant,
    "hot-spot": _hot_spot,
}

_ARRIVALS = ("seed", "rate_per_s", "duration_s", "max_requests")
_DOCUMENTS = ("documents", "doc_tokens", "zipf_s", "question_tokens", "output_tokens")
WORKLOAD_PARAMETERS: dict[WorkloadName, tuple[str, ...]] = {
    "long-context": _ARRIVALS + _DOCUMENTS,
    "long-context-short-prefix": _ARRIVALS + _DOCUMENTS + ("shared_preamble_tokens",),
    "hot-spot": _ARRIVALS + _DOCUMENTS + ("hot_share",),
    "conversations": (
        *_ARRIVALS,
        "conversation_turns_mean",
        "conversation_turns_max",
        "chat_system_tokens",
        "user_turn_tokens_mean",
        "assistant_turn_tokens_mean",
        "turn_tokens_sigma",
        "turn_tokens_max",
        "think_time_mean_s",
    ),
    "multi-tenant": (
        *_ARRIVALS,
        "tenants",
        "tenant_system_tokens",
        "tenant_context_tokens",
        "tenants_with_body_key",
        "question_tokens",
        "output_tokens",
    ),
}


def generate(spec: WorkloadSpec, model: str = "sim-model") -> list[BenchRequest]:
    """The request schedule of ``spec``, sorted by arrival; same spec, same schedule."""
    return WORKLOADS[spec.name](spec, model)


def _summary(spec: WorkloadSpec) -> str:
    s = spec
    documents = (
        f"{s.documents} documents of ~{s.doc_tokens} tokens; each request sends one whole "
        f"document as the system message plus a ~{s.question_tokens}-token question that "
        f"differs per request, and streams {s.output_tokens} output tokens"
    )
    zipf = f"Zipf(s={s.zipf_s}) popularity over documents"
    if s.name == "long-context":
        return f"{documents}; {zipf}."
    if s.name == "long-context-short-prefix":
        shared_chars = s.shared_preamble_tokens * CHARS_PER_TOKEN
        return (
            f"{documents}; {zipf}. Every document starts with the same "
            f"{s.shared_preamble_tokens}-token ({shared_chars}-character) preamble, so a "
            f"router whose PrefixLength is at most ~{shared_chars} characters gives every "
            "document one key."
        )
    if s.name == "hot-spot":
        return (
            f"{documents}; document 0 takes {s.hot_share:.0%} of requests, the rest follow {zipf}."
        )
    if s.name == "conversations":
        return (
            "Multi-turn chats; each request resends the system prompt "
            f"(~{s.chat_system_tokens} tokens) and the whole history plus a new user turn. "
            "Shapes are ShareGPT-like (ShareGPT: 3.51 turns per conversation, per the "
            "LMSYS-Chat-1M paper): turns per conversation geometric with mean "
            f"{s.conversation_turns_mean}, at most {s.conversation_turns_max}; user and "
            f"assistant turns lognormal (sigma {s.turn_tokens_sigma}) with means "
            f"~{s.user_turn_tokens_mean:g} and ~{s.assistant_turn_tokens_mean:g} tokens, "
            f"capped at {s.turn_tokens_max}; max_tokens is the assistant turn's length. "
            f"Conversations start as a Poisson process at rate_per_s / "
            f"{s.conversation_turns_mean}; the client sends turn k+1 an exponential think "
            f"time (mean {s.think_time_mean_s} s) after the reply to turn k has ended, as a "
            f"client that resends the reply must."
        )
    body_key = s.tenants_with_body_key
    return (
        f"{s.tenants} tenants share one ~{s.tenant_system_tokens}-token system prompt, "
        f"followed by a ~{s.tenant_context_tokens}-token tenant context and a "
        f"~{s.question_tokens}-token question; {s.output_tokens} output tokens. Tenants are "
        f"equally likely; {s.tenants - body_key} send `{TENANT_HEADER}: tenant-<i>`, the last "
        f"{body_key} send `{TENANT_BODY_FIELD}` in the body."
    )


def describe(spec: WorkloadSpec) -> str:
    """A markdown paragraph for the report: the shape, then every parameter used."""
    parameters = ", ".join(
        f"`{name}`={getattr(spec, name)}" for name in WORKLOAD_PARAMETERS[spec.name]
    )
    bounds = []
    if spec.duration_s is not None:
        bounds.append(f"{spec.duration_s} s")
    if spec.max_requests is not None:
        bounds.append(f"{spec.max_requests} requests")
    bound = " or ".join(bounds) + (", whichever comes first" if len(bounds) == 2 else "")
    return (
        f"**{spec.name}**: {_summary(spec)} Open-loop arrivals at ~{spec.rate_per_s} "
        f"requests/s (seed {spec.seed}) for {bound}; every request carries "
        f"`{SESSION_HEADER}` = its group. Parameters: {parameters}."
    )
