"""Router configuration: a frozen pydantic model, validated once, from YAML plus environment.

Precedence, lowest first: defaults, the YAML file, ``PREFIX_ROUTER_<FIELD>`` environment
variables, then explicit overrides (the CLI's flags). Every error names the field, the
value and the allowed range. Each field's description, type, default and range are
declared once, here: docs/configuration.md and the JSON Schema are rendered from them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    WithJsonSchema,
    model_validator,
)

from extproc import ports
from extproc.errors import ConfigError
from extproc.picker.decide import Strategy
from extproc.picker.keys import KeyMode
from extproc.schema import (
    LOG_LEVELS,
    LOOPBACK_ENDPOINT,
    MAX_SOCKET_PATH_BYTES,
    PEM_FILE,
    AbsolutePath,
    Address,
    FrozenModel,
    HeaderName,
    ListenAddress,
    LogLevel,
    LoopbackEndpoint,
    Name,
    Number,
    PemFile,
    check_ca,
    check_key_pair,
    check_needs,
    described,
    env_values,
    finite,
    read_config_file,
    socket_path,
    validated,
)

__all__ = ["ENV_PREFIX", "LOG_LEVELS", "EventLoop", "PrefixMatch", "RouterConfig", "load_config"]

ENV_PREFIX = "PREFIX_ROUTER_"
# Listen addresses that take a port on every IP.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "[::]"})


class StreamEnd(StrEnum):
    """When the router ends a request's ext_proc stream."""

    # Envoy ends it with the HTTP response: in-flight counts are exact.
    RESPONSE = "response"
    # The router closes it once it has answered: Envoy holds nothing for a long response.
    DECISION = "decision"


class EventLoop(StrEnum):
    """The asyncio event loop the router's gRPC server runs on."""

    ASYNCIO = "asyncio"
    # libuv's loop (uvloop): measured side by side in docs/benchmarks/overhead.md.
    UVLOOP = "uvloop"


class PrefixMatch(StrEnum):
    """How PREFIX_AWARE matches prompts to hosts."""

    # The prefix index: the host holding the longest part of the prompt, block by block.
    LONGEST = "longest"
    # SageMaker's behaviour: a hash of the first prefix_length characters (or bytes).
    FIXED = "fixed"


# Optional, so its range sits inside the Annotated (JSON Schema then shows it).
BalanceFactor = Annotated[float, Strict(), Field(ge=1.0, le=10), AfterValidator(finite)]
PrefillRate = Annotated[float, Field(ge=100, le=100_000_000), AfterValidator(finite)]
ShedLag = Annotated[float, Field(ge=0, le=60), AfterValidator(finite)]
MAX_WORKERS = 64


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset
    sets; not a CFS quota), within 1 to MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def _auto_workers(value: Any) -> Any:
    return usable_cores() if value == "auto" else value


# A number of processes, or "auto": one per usable core, resolved when the config loads.
Workers = Annotated[
    StrictInt,
    BeforeValidator(_auto_workers),
    Field(ge=1, le=MAX_WORKERS),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_WORKERS}, {"const": "auto"}]}
    ),
]


class RouterConfig(FrozenModel):
    """Everything the router needs; the names follow SageMaker's PREFIX_AWARE routing."""

    routing_strategy: Strategy = described(
        "How to pick the upstream: PREFIX_AWARE places each prompt prefix on a "
        "consistent host; RANDOM and LEAST_OUTSTANDING_REQUESTS ignore the prompt.",
        Strategy.PREFIX_AWARE,
    )
    prefix_match: PrefixMatch = described(
        "How PREFIX_AWARE matches a prompt: longest: the prefix index sends it to the "
        "host holding the longest part of it, block by block; fixed: SageMaker's "
        "behaviour, a hash of the first prefix_length characters.",
        PrefixMatch.LONGEST,
    )
    prefix_length: StrictInt = described(
        "prefix_match fixed: how much of the prompt forms the routing key: characters "
        "of message text (openai) or bytes of the raw body (native).",
        8192,
        ge=1024,
        le=65536,
    )
    block_bytes: StrictInt = described(
        "prefix_match longest: the prompt is hashed in blocks of this many bytes of "
        "message text (characters, for ASCII); a prompt shorter than one block matches "
        "nothing.",
        512,
        ge=64,
        le=8192,
    )
    match_depth_chars: StrictInt = described(
        "prefix_match longest: how deep into the prompt matching goes, in characters "
        "of message text (openai) or bytes of the raw body (native).",
        65536,
        ge=65536,
        le=1048576,
    )
    index_max_blocks: StrictInt = described(
        "prefix_match longest: the prefix index's memory bound, in blocks over all "
        "hosts (see docs/benchmarks/prefix-index.md for bytes per block).",
        262_144,
        ge=1024,
        le=16_777_216,
    )
    index_host_tokens: StrictInt = described(
        "prefix_match longest: the KV cache size, in tokens, assumed for a host that "
        "does not publish vllm:cache_config_info.",
        1_000_000,
        ge=1024,
        le=1_000_000_000,
    )
    chars_per_token: Number = described(
        "prefix_match longest: characters per token, to size each host's part of the "
        "index from its KV cache size in tokens.",
        4.0,
        ge=1,
        le=16,
    )
    kv_events: StrictBool = described(
        "prefix_match longest: use the engines' own KV-cache events (vLLM's "
        "--kv-events-config) wherever a host publishes them: the router finds each host's "
        "publisher at GET /kv_event_sources, subscribes, and reads that host's cache from "
        "its events, so every router process and replica sees the same caches. Hosts that "
        "publish nothing, or whose stream is silent, keep the approximate index.",
        True,
        restart=True,
    )
    kv_events_speculative_ttl_s: Number = described(
        "kv_events: how long a decision counts as cached on its host before an event "
        "confirms it, so a burst of one new prompt does not scatter meanwhile.",
        10.0,
        ge=0.5,
        le=300,
        restart=True,
    )
    kv_events_silent_after_s: Number = described(
        "kv_events: a host whose publisher neither sends an event nor answers a replay "
        "probe for this long falls back to the approximate index until it does.",
        10.0,
        ge=1,
        le=300,
        restart=True,
    )
    kv_events_tokenizer: AbsolutePath | None = described(
        "kv_events: a tokenizer.json (or the model directory holding it) to decode the "
        "engines' token ids with, for engines whose model the router cannot find on "
        "its own (the path vLLM's /v1/models names, or the Hugging Face cache). null: "
        "find it.",
        None,
        allowed="an absolute path, or null",
        restart=True,
    )
    hot_prefix_factor: Number = described(
        "prefix_match longest: a prefix carried by more than this multiple of one "
        "host's fair share (1/hosts) of recent requests is hot, and is spread over "
        "share x hosts / hot_prefix_factor hosts (a shared system prompt: all of them).",
        1.0,
        ge=0.5,
        le=16,
    )
    overload_cost: Number = described(
        "prefix_match longest: what one request in flight beyond the balance bound "
        "costs a host, as a share of the prompt to prefill: a host holding this much "
        "more of the prompt than another still wins it at one request over the bound.",
        0.25,
        ge=0,
        le=100,
    )
    prefill_tokens_per_s: PrefillRate | None = described(
        "prefix_match longest: how many prompt tokens one engine prefills a second. Each "
        "decision queues the tokens its host lacks, the queue drains at this rate, and a "
        "host's queue counts in the cost like prefill of the prompt's own, so a burst of "
        "new prompts spreads over idle hosts instead of queueing on one. null: not "
        "counted.",
        30000.0,
    )
    concurrency_threshold: StrictInt = described(
        "Requests in flight on a host at which new requests for its prefixes overflow "
        "to the prefix's next host.",
        32,
        ge=1,
        le=1024,
    )
    balance_factor: BalanceFactor | None = described(
        "PREFIX_AWARE's balance bound: this multiple of the fleet's mean in flight "
        "(bounded-load consistent hashing, never below balance_min_in_flight). fixed "
        "overflows a host at its bound; longest charges overload_cost for each "
        "request beyond it. null turns it off.",
        2.0,
    )
    balance_min_in_flight: StrictInt = described(
        "The balance bound is never below this many requests in flight, so a lightly "
        "loaded fleet never overflows because a few requests overlap.",
        4,
        ge=1,
        le=1024,
    )
    key_mode: KeyMode = described(
        "openai: the key is the message text of an OpenAI chat or completions body; "
        "native: the first bytes of the raw body.",
        KeyMode.OPENAI,
    )
    trusted_salt_header: HeaderName | None = described(
        "Take the tenant salt only from this request header, which a trusted filter in "
        "front of the router sets (an authenticating filter mapping the caller to its "
        "tenant); the client's x-prefix-aware-id, x-amzn-sagemaker-prefix-aware-id and "
        "prompt_cache_key are then ignored. Generate the bootstrap with `envoy-config "
        "--trusted-salt-header NAME` so Envoy strips the client's own copy first. null: "
        "the salt comes from the client, which may set any salt: it moves placement but "
        "isolates nothing in vLLM's cache.",
        None,
        allowed="a lower-case header name",
    )
    hosts: tuple[Address, ...] = described(
        "The static host set, for running without a control plane.",
        (),
        allowed="ip:port entries; empty when control_plane is set",
    )
    control_plane: Address | None = described(
        "The control plane's xDS address; the host set and the load feed come from it.",
        None,
        allowed="ip:port",
        restart=True,
    )
    cluster: Name = described(
        "The cluster (EDS resource) the control plane publishes the fleet as.",
        "vllm",
        allowed="a non-empty name",
        restart=True,
    )
    load_feed_max_age_s: Number = described(
        "A load feed older than this is ignored, and overflow uses this router's own "
        "in-flight counts only.",
        2.0,
        ge=0.1,
        le=600,
    )
    stream_end: StreamEnd = described(
        "When each ext_proc stream ends. response: Envoy keeps it open until the HTTP "
        "response ends, and this router counts the request in flight until then. "
        "decision: the router closes it as soon as it has answered, so Envoy holds no "
        "stream or circuit-breaker slot through a long LLM response; a host's load is "
        "then the load feed's running + waiting plus this router's decisions the feed "
        "cannot show yet (each for at most load_feed_max_age_s).",
        StreamEnd.RESPONSE,
    )
    shed_lag_s: ShedLag | None = described(
        "When the router's event loop runs later than this (the second worst of its "
        "recent wake-ups: one late wake-up is a pause, not a loop running late), it "
        "sheds: each new request is decided on its headers alone (the least loaded host) "
        "and its stream ends there, so Envoy sends no body and waits for no "
        "second answer, and it is counted (prefix_router_shed_total), instead of Envoy's "
        "message_timeout (0.5 s in the generated bootstraps) failing it open unseen. "
        "Keep it well under that timeout. 0 sheds every request (an emergency switch: "
        "routing by load alone, no body read). Not done for a fleet whose hosts serve "
        "different models (a LoRA adapter's requests need the body). null: never shed.",
        0.2,
    )
    shed_backlog: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = described(
        "When this many ext_proc streams are open and not yet decided, a new one is shed "
        "as above (decided on its headers alone, counted in prefix_router_shed_total). A "
        "burst opens thousands of streams within one turn of the event loop, before its "
        "lag can show: each waiting message then passes Envoy's message_timeout in grpc's "
        "queues, not in the loop (docs/benchmarks/burst.md). The default is about what "
        "one router process decides on the body in 0.2 s on 2 cores. null: shed by the "
        "lag alone.",
        256,
    )
    max_body_bytes: StrictInt = described(
        "The largest request body routed. A larger one is refused at once with 413: at "
        "its headers when its content-length says so, else as soon as more than this has "
        "arrived; counted in prefix_router_refused_total. Keep Envoy's buffer limit "
        "(`envoy-config --buffer-limit-bytes`, 40 MiB by default) above it: a body that "
        "overflows that limit can hang in Envoy 1.40 (docs/architecture.md).",
        32 * 1024 * 1024,
        ge=1024 * 1024,
        le=1024 * 1024 * 1024,
    )
    failover_hosts: StrictInt = described(
        "Extra hosts in the target list, tried in turn by Envoy's retries (override-host mode).",
        2,
        ge=0,
        le=8,
    )
    epp: StrictBool = described(
        "Serve as a Gateway API Inference Extension endpoint picker (protocol 1.0.0): the "
        "decision goes in the x-gateway-destination-endpoint header and the envoy.lb "
        "metadata alike; a gateway's subset hint limits the choice (503 when nothing in it "
        "is eligible); the served endpoint the gateway reports corrects the accounting. "
        "`prefix-router epp` turns it on (docs/kubernetes.md).",
        False,
        restart=True,
    )
    epp_endpoint_list: StrictBool = described(
        "In epp mode, send the ordered list of 1 + failover_hosts endpoints instead of one "
        "(the gateway tries the next on a retry).",
        False,
    )
    epp_conformance_hooks: StrictBool = described(
        "In epp mode, honour the conformance suite's test-epp-endpoint-selection request "
        "header, which names the endpoints a request must go to, and echo the served "
        "endpoint. For conformance runs only: it lets a client choose the upstream.",
        False,
    )
    health_listen: Address | None = described(
        "A second address serving only gRPC health (liveness, readiness, the ext_proc "
        "service and inference-extension), as the Inference Extension's charts probe on "
        "9003. The listen address serves health too. Every worker of `workers` binds this "
        "same address (SO_REUSEPORT), so a probe reaches one of them. null: none.",
        None,
        allowed="ip:port",
        restart=True,
    )
    shadow: StrictBool = described(
        "Shadow mode: whatever the strategy, also compute where PREFIX_AWARE by longest "
        "match would send each request, over its own model of each host's prefix cache, and "
        "export what it predicts (hit rate, each host's share, overflow) beside what the "
        "live strategy gets (docs/operations.md, Shadow mode). Applied on reload; turning it "
        "on starts the model empty.",
        False,
    )
    traffic_log: AbsolutePath | None = described(
        "Write one record per routed request to this file, whatever the strategy: the "
        "prompt's block hashes, lengths, model and a hash of its salt, never its text "
        "(docs/operations.md, Traffic log). `prefix-router replay` predicts from it what "
        "each strategy and setting would get. null: no log.",
        None,
        allowed="an absolute file path",
        restart=True,
    )
    traffic_log_max_bytes: StrictInt = described(
        "The traffic log's file is rotated at this size.",
        64 * 1024 * 1024,
        ge=1024 * 1024,
        le=64 * 1024 * 1024 * 1024,
        restart=True,
    )
    traffic_log_files: StrictInt = described(
        "Files the traffic log keeps, the current one included: it never holds more than "
        "traffic_log_files x traffic_log_max_bytes.",
        8,
        ge=2,
        le=1000,
        restart=True,
    )
    listen: ListenAddress = described(
        "The gRPC (ext_proc) address: ip:port, or a Unix socket (unix:/absolute/path) for "
        "an Envoy on the same machine or in the same pod (a shared volume).",
        ports.loopback(ports.ROUTER_GRPC),
        allowed="ip:port or unix:/absolute/path",
        restart=True,
    )
    metrics_listen: Address = described(
        "The Prometheus metrics address.",
        ports.loopback(ports.ROUTER_METRICS),
        allowed="ip:port",
        restart=True,
    )
    workers: Workers = described(
        "Router processes. grpc.aio serves from one core, so a router per core multiplies "
        "its capacity: worker i listens on listen's port + i (on a Unix socket: its path "
        "with .i appended, from worker 1; all on listen itself with workers_share_listen) "
        "and metrics_listen's port + i, and each is an endpoint of Envoy's ext_proc cluster "
        "(`envoy-config --router-workers`). A worker that dies is restarted. auto: one per "
        "core this process may run on (its CPU affinity). The default is 1 because a "
        "worker only pays with a core of its own: on 2 cores shared with Envoy, 2 workers "
        "raised neither the throughput nor the saturation point "
        "(docs/benchmarks/reliability.md).",
        1,
        allowed="an integer from 1 to 64, or auto",
        restart=True,
    )
    workers_share_listen: StrictBool = described(
        "Every worker listens on listen itself, with SO_REUSEPORT, and the kernel spreads "
        "new connections over them: for a client that knows one address, as a gateway "
        "knows its endpoint picker's Service (`prefix-router epp` turns it on). false: "
        "listen is this process's alone (a second process on it fails to start), and "
        "worker i takes its port + i. metrics_listen's port + i either way. ip:port listen "
        "only.",
        False,
        restart=True,
    )
    workers_share_decisions: StrictBool = described(
        "With workers above 1: each worker tells the others every decision it records in "
        "its prefix index (the host, and the prompt's block hashes, which carry its model "
        "and salt), over ZMQ on ipc sockets in a private temporary folder, within about "
        "2 ms, and records theirs as it records its own (speculative entries where the "
        "host's KV events are read). So a burst of one new "
        "prompt spread over the workers goes to one host, not one host per worker, before "
        "the engines' KV events (still the source of truth) confirm it, and where no "
        "events come. Counted in prefix_router_decisions_published_total and "
        "prefix_router_sibling_decisions_applied_total/_dropped_total. false: each worker "
        "knows only its own decisions, as replicas do.",
        True,
        restart=True,
    )
    decision_exchange_bind: LoopbackEndpoint | None = described(
        "For router processes on one machine that are not workers of one supervisor (set "
        "per worker by the supervisor otherwise): publish this router's decisions on this "
        "ZMQ endpoint, for the routers that list it in their decision_exchange_peers. "
        "Loopback only: the messages are neither authenticated nor encrypted (an ipc "
        "socket is guarded by its folder's permissions). null: publish nothing.",
        None,
        allowed=LOOPBACK_ENDPOINT,
        restart=True,
    )
    decision_exchange_peers: tuple[LoopbackEndpoint, ...] = described(
        "The decision_exchange_bind endpoints of the other routers on this machine: this "
        "router records each decision they publish as it records its own "
        "(one naming a host outside its host set is dropped and counted). Empty: none.",
        (),
        allowed=LOOPBACK_ENDPOINT,
        restart=True,
    )
    event_loop: EventLoop = described(
        "The event loop the router runs on: uvloop (libuv), or asyncio's own. The Levers "
        "table of docs/benchmarks/overhead.md measures one against the other.",
        EventLoop.UVLOOP,
        restart=True,
    )
    drain_timeout_s: Number = described(
        "On SIGTERM, how long open ext_proc streams may take to finish before they are "
        "cancelled (after the health checks have seen NOT_SERVING, up to 3 s). In "
        "buffered-partial mode a stream lasts as long as its LLM response, so this is the "
        "longest response a rollout lets finish; give the pod (terminationGracePeriodSeconds) "
        "and Envoy's own drain (--drain-time-s) at least this plus 5 s.",
        300.0,
        ge=1.0,
        le=3600.0,
    )
    tls_cert_file: PemFile | None = described(
        "TLS on listen (ext_proc, the completion log and Envoy's health checks): the "
        "certificate chain this router presents, PEM; with tls_key_file. Envoy's router "
        "cluster then needs a TLS context (`envoy-config --router-tls-ca`). ip:port "
        "listen only: a Unix socket is guarded by its file permissions. null: plaintext.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    tls_key_file: PemFile | None = described(
        "The private key of tls_cert_file, PEM.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    tls_client_ca_file: PemFile | None = described(
        "mTLS on listen: the CA certificates a client's certificate must chain to. Set, "
        "a client that presents no certificate, or one these CAs did not sign, is refused "
        "in the TLS handshake (`envoy-config --router-tls-cert/--router-tls-key` give "
        "Envoy its certificate). Needs tls_cert_file.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    control_plane_ca_file: PemFile | None = described(
        "TLS to the control plane: the CA certificates its certificate must chain to. "
        "The certificate must also name control_plane's IP (an IP subjectAltName), or "
        "control_plane_server_name. null: plaintext.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    control_plane_cert_file: PemFile | None = described(
        "mTLS to the control plane: the certificate chain this router presents (signed by "
        "a CA of the control plane's tls_client_ca_file), PEM; with control_plane_key_file. "
        "Needs control_plane_ca_file.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    control_plane_key_file: PemFile | None = described(
        "The private key of control_plane_cert_file, PEM.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    control_plane_server_name: Name | None = described(
        "The DNS name the control plane's certificate must carry (and the TLS server "
        "name sent), when it names a host rather than control_plane's IP.",
        None,
        allowed="a DNS name",
        restart=True,
    )
    log_level: LogLevel = described("The lowest level logged.", "info")

    @model_validator(mode="after")
    def _hosts_or_control_plane(self) -> RouterConfig:
        if self.control_plane is not None and self.hosts:
            raise ConfigError(
                "hosts", self.hosts, "empty when control_plane is set (it supplies the hosts)"
            )
        return self

    @model_validator(mode="after")
    def _worker_ports_exist(self) -> RouterConfig:
        if self.workers_share_listen and socket_path(self.listen) is not None:
            raise ConfigError(
                "workers_share_listen",
                True,
                "false when listen is a Unix socket (only a TCP port can be shared)",
            )
        for name in ("listen", "metrics_listen"):
            if name == "listen" and self.workers_share_listen:
                continue  # every worker on listen itself
            address = getattr(self, name)
            path = socket_path(address)
            if path is not None:
                last = f"{path}.{self.workers - 1}" if self.workers > 1 else path
                if len(last.encode()) > MAX_SOCKET_PATH_BYTES:
                    raise ConfigError(
                        "workers",
                        self.workers,
                        f"fewer, or a shorter {name} path: worker {self.workers - 1} would "
                        f"listen on {last}, over {MAX_SOCKET_PATH_BYTES} bytes",
                    )
                continue
            port = int(address.rpartition(":")[2])
            if port + self.workers - 1 > 65535:
                raise ConfigError(
                    "workers",
                    self.workers,
                    f"at most {65536 - port} with {name} on port {port} (worker i listens on "
                    "its port + i)",
                )
        return self

    @model_validator(mode="after")
    def _decision_exchange_apart(self) -> RouterConfig:
        own = self.decision_exchange_bind
        if self.workers > 1 and own is not None:
            raise ConfigError(
                "decision_exchange_bind",
                own,
                "null when workers > 1 (every worker would bind it; with "
                "workers_share_decisions the supervisor gives each worker its own)",
            )
        if self.workers > 1 and self.workers_share_decisions and self.decision_exchange_peers:
            raise ConfigError(
                "decision_exchange_peers",
                self.decision_exchange_peers,
                "empty when workers > 1 and workers_share_decisions (the supervisor gives "
                "each worker its siblings' endpoints)",
            )
        peers = self.decision_exchange_peers
        if own is not None and own in peers:
            raise ConfigError(
                "decision_exchange_peers",
                peers,
                f"endpoints of other routers, not this one's decision_exchange_bind ({own})",
            )
        if len(set(peers)) != len(peers):
            raise ConfigError("decision_exchange_peers", peers, "each endpoint once")
        return self

    @model_validator(mode="after")
    def _worker_ports_apart(self) -> RouterConfig:
        # Every worker binds the shared addresses with SO_REUSEPORT, so two servers on one
        # port would not fail: they would split its connections. Refuse the overlap here.
        own = 1 if self.workers_share_listen else self.workers
        spans = (
            ("listen", self.listen, own),
            ("health_listen", self.health_listen, 1),
            ("metrics_listen", self.metrics_listen, self.workers),
        )
        taken: list[tuple[str, str, range]] = []
        for name, address, count in spans:
            if address is None or socket_path(address) is not None:
                continue
            host, _, port = address.rpartition(":")
            ports_of = range(int(port), int(port) + count)
            for other, other_host, other_ports in taken:
                same_ip = host == other_host or bool({host, other_host} & WILDCARD_HOSTS)
                both = sorted(set(ports_of) & set(other_ports))
                if same_ip and both:
                    raise ConfigError(
                        name,
                        address,
                        f"ports apart from {other}'s: with {self.workers} worker(s) both "
                        f"would take port {both[0]}",
                    )
            taken.append((name, host, ports_of))
        return self

    @model_validator(mode="after")
    def _tls_settings_agree(self) -> RouterConfig:
        check_key_pair(self, "tls_cert_file", "tls_key_file")
        check_needs(
            self,
            "tls_client_ca_file",
            "tls_cert_file",
            "a client certificate is asked for in a TLS handshake",
        )
        check_ca(self, "tls_client_ca_file")
        if self.tls_cert_file is not None and socket_path(self.listen) is not None:
            raise ConfigError(
                "tls_cert_file",
                self.tls_cert_file,
                "null when listen is a Unix socket (its file permissions guard it)",
            )
        for name in (
            "control_plane_ca_file",
            "control_plane_cert_file",
            "control_plane_server_name",
        ):
            check_needs(self, name, "control_plane", "it applies to the link to the control plane")
        check_key_pair(self, "control_plane_cert_file", "control_plane_key_file")
        for name in ("control_plane_cert_file", "control_plane_server_name"):
            check_needs(
                self, name, "control_plane_ca_file", "TLS to the control plane needs its CA"
            )
        check_ca(self, "control_plane_ca_file")
        return self


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update(env_values(RouterConfig, os.environ if env is None else env, ENV_PREFIX))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return validated(RouterConfig, values)
