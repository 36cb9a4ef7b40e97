"""Router configuration: a frozen object, validated once, from YAML plus environment.

Precedence, lowest first: defaults, the YAML file, ``PREFIX_ROUTER_<FIELD>`` environment
variables, then explicit overrides (the CLI's flags). Every error names the field, the
value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from extproc.errors import ConfigError
from extproc.picker.decide import Strategy
from extproc.picker.hosts import parse_host_address
from extproc.picker.keys import KeyMode

ENV_PREFIX = "PREFIX_ROUTER_"

PREFIX_LENGTH_RANGE = (1024, 65536)
CONCURRENCY_THRESHOLD_RANGE = (1, 1024)
FAILOVER_HOSTS_RANGE = (0, 8)
BLOCK_BYTES_RANGE = (64, 8192)
MATCH_DEPTH_RANGE = (65536, 1048576)
INDEX_MAX_BLOCKS_RANGE = (1024, 16_777_216)
INDEX_HOST_TOKENS_RANGE = (1024, 1_000_000_000)
BALANCE_MIN_RANGE = (1, 1024)
OVERLOAD_COST_RANGE = (0, 100)


class PrefixMatch(StrEnum):
    """How PREFIX_AWARE matches prompts to hosts."""

    # The prefix index: the host holding the longest part of the prompt, block by block.
    LONGEST = "longest"
    # SageMaker's behaviour: a hash of the first prefix_length characters (or bytes).
    FIXED = "fixed"


LOG_LEVELS = ("debug", "info", "warning", "error")


def doc(text: str, **constraints: Any) -> dict[str, Any]:
    """Field metadata that documents a config field where it is declared.

    ``text`` says what the field does; ``range=(low, high)`` (a bound may name a sibling
    field) or ``allowed="..."`` say which values it accepts. docs/configuration.md is
    rendered from this metadata (``prefix-router config-reference``), and a test checks
    every ``range`` against the validation, so the reference cannot drift from the schema.
    """
    return {"doc": text, **constraints}


def _check_range(name: str, value: Any, bounds: tuple[int, int]) -> int:
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(name, value, f"an integer from {low} to {high}")
    return value


def _check_listen(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, value, "an ip:port string")
    try:
        return parse_host_address(value)
    except ValueError:
        raise ConfigError(name, value, "an ip:port string with a port from 1 to 65535") from None


def _check_number(name: str, value: Any, bounds: tuple[float, float]) -> float:
    low, high = bounds
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ConfigError(name, value, f"a number from {low:g} to {high:g}")
    return float(value)


def _check_enum(name: str, value: Any, enum: type[StrEnum]) -> Any:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise ConfigError(name, value, f"one of {allowed}") from None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs; the names follow SageMaker's PREFIX_AWARE routing."""

    routing_strategy: Strategy = field(
        default=Strategy.PREFIX_AWARE,
        metadata=doc(
            "How to pick the upstream: PREFIX_AWARE places each prompt prefix on a "
            "consistent host; RANDOM and LEAST_OUTSTANDING_REQUESTS ignore the prompt."
        ),
    )
    prefix_match: PrefixMatch = field(
        default=PrefixMatch.LONGEST,
        metadata=doc(
            "How PREFIX_AWARE matches a prompt: longest: the prefix index sends it to the "
            "host holding the longest part of it, block by block; fixed: SageMaker's "
            "behaviour, a hash of the first prefix_length characters."
        ),
    )
    prefix_length: int = field(
        default=8192,
        metadata=doc(
            "prefix_match fixed: how much of the prompt forms the routing key: characters "
            "of message text (openai) or bytes of the raw body (native).",
            range=PREFIX_LENGTH_RANGE,
        ),
    )
    block_bytes: int = field(
        default=512,
        metadata=doc(
            "prefix_match longest: the prompt is hashed in blocks of this many bytes of "
            "message text (characters, for ASCII); a prompt shorter than one block matches "
            "nothing.",
            range=BLOCK_BYTES_RANGE,
        ),
    )
    match_depth_chars: int = field(
        default=65536,
        metadata=doc(
            "prefix_match longest: how deep into the prompt matching goes, in characters "
            "of message text (openai) or bytes of the raw body (native).",
            range=MATCH_DEPTH_RANGE,
        ),
    )
    index_max_blocks: int = field(
        default=262_144,
        metadata=doc(
            "prefix_match longest: the prefix index's memory bound, in blocks over all "
            "hosts (see docs/benchmarks/prefix-index.md for bytes per block).",
            range=INDEX_MAX_BLOCKS_RANGE,
        ),
    )
    index_host_tokens: int = field(
        default=1_000_000,
        metadata=doc(
            "prefix_match longest: the KV cache size, in tokens, assumed for a host that "
            "does not publish vllm:cache_config_info.",
            range=INDEX_HOST_TOKENS_RANGE,
        ),
    )
    chars_per_token: float = field(
        default=4.0,
        metadata=doc(
            "prefix_match longest: characters per token, to size each host's part of the "
            "index from its KV cache size in tokens.",
            range=(1, 16),
        ),
    )
    hot_prefix_factor: float = field(
        default=1.0,
        metadata=doc(
            "prefix_match longest: a prefix carried by more than this multiple of one "
            "host's fair share (1/hosts) of recent requests is hot, and is spread over "
            "share x hosts / hot_prefix_factor hosts (a shared system prompt: all of them).",
            range=(0.5, 16),
        ),
    )
    overload_cost: float = field(
        default=0.25,
        metadata=doc(
            "prefix_match longest: what one request in flight beyond the balance bound "
            "costs a host, as a share of the prompt to prefill: a host holding this much "
            "more of the prompt than another still wins it at one request over the bound.",
            range=OVERLOAD_COST_RANGE,
        ),
    )
    concurrency_threshold: int = field(
        default=32,
        metadata=doc(
            "Requests in flight on a host at which new requests for its prefixes overflow "
            "to the prefix's next host.",
            range=CONCURRENCY_THRESHOLD_RANGE,
        ),
    )
    balance_factor: float | None = field(
        default=1.5,
        metadata=doc(
            "PREFIX_AWARE's balance bound: this multiple of the fleet's mean in flight "
            "(bounded-load consistent hashing, never below balance_min_in_flight). fixed "
            "overflows a host at its bound; longest charges overload_cost_chars for each "
            "request beyond it. null turns it off.",
            range=(1.0, 10),
        ),
    )
    balance_min_in_flight: int = field(
        default=4,
        metadata=doc(
            "The balance bound is never below this many requests in flight, so a lightly "
            "loaded fleet never overflows because a few requests overlap.",
            range=BALANCE_MIN_RANGE,
        ),
    )
    key_mode: KeyMode = field(
        default=KeyMode.OPENAI,
        metadata=doc(
            "openai: the key is the message text of an OpenAI chat or completions body; "
            "native: the first bytes of the raw body."
        ),
    )
    hosts: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "The static host set, for running without a control plane.",
            allowed="ip:port entries; empty when control_plane is set",
        ),
    )
    control_plane: str | None = field(
        default=None,
        metadata=doc(
            "The control plane's xDS address; the host set and the load feed come from it.",
            allowed="ip:port",
        ),
    )
    cluster: str = field(
        default="vllm",
        metadata=doc(
            "The cluster (EDS resource) the control plane publishes the fleet as.",
            allowed="a non-empty name",
        ),
    )
    load_feed_max_age_s: float = field(
        default=2.0,
        metadata=doc(
            "A load feed older than this is ignored, and overflow uses this router's own "
            "in-flight counts only.",
            range=(0.1, 600),
        ),
    )
    failover_hosts: int = field(
        default=2,
        metadata=doc(
            "Extra hosts in the target list, tried in turn by Envoy's retries "
            "(override-host mode).",
            range=FAILOVER_HOSTS_RANGE,
        ),
    )
    listen: str = field(
        default="127.0.0.1:50051", metadata=doc("The gRPC (ext_proc) address.", allowed="ip:port")
    )
    metrics_listen: str = field(
        default="127.0.0.1:9102", metadata=doc("The Prometheus metrics address.", allowed="ip:port")
    )
    log_level: str = field(
        default="info", metadata=doc("The lowest level logged.", allowed=", ".join(LOG_LEVELS))
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(
            self,
            "routing_strategy",
            _check_enum("routing_strategy", self.routing_strategy, Strategy),
        )
        set_(self, "key_mode", _check_enum("key_mode", self.key_mode, KeyMode))
        set_(self, "prefix_match", _check_enum("prefix_match", self.prefix_match, PrefixMatch))
        _check_range("prefix_length", self.prefix_length, PREFIX_LENGTH_RANGE)
        _check_range("block_bytes", self.block_bytes, BLOCK_BYTES_RANGE)
        _check_range("match_depth_chars", self.match_depth_chars, MATCH_DEPTH_RANGE)
        _check_range("index_max_blocks", self.index_max_blocks, INDEX_MAX_BLOCKS_RANGE)
        _check_range("index_host_tokens", self.index_host_tokens, INDEX_HOST_TOKENS_RANGE)
        _check_range("balance_min_in_flight", self.balance_min_in_flight, BALANCE_MIN_RANGE)
        set_(
            self,
            "overload_cost",
            _check_number("overload_cost", self.overload_cost, OVERLOAD_COST_RANGE),
        )
        set_(
            self, "chars_per_token", _check_number("chars_per_token", self.chars_per_token, (1, 16))
        )
        set_(
            self,
            "hot_prefix_factor",
            _check_number("hot_prefix_factor", self.hot_prefix_factor, (0.5, 16)),
        )
        _check_range(
            "concurrency_threshold", self.concurrency_threshold, CONCURRENCY_THRESHOLD_RANGE
        )
        _check_range("failover_hosts", self.failover_hosts, FAILOVER_HOSTS_RANGE)
        set_(self, "listen", _check_listen("listen", self.listen))
        set_(self, "metrics_listen", _check_listen("metrics_listen", self.metrics_listen))
        if isinstance(self.hosts, str) or not isinstance(self.hosts, (list, tuple)):
            raise ConfigError("hosts", self.hosts, "a list of ip:port strings")
        normalised = []
        for index, host in enumerate(self.hosts):
            try:
                normalised.append(parse_host_address(str(host)))
            except ValueError as error:
                raise ConfigError(f"hosts[{index}]", host, f"ip:port ({error})") from None
        set_(self, "hosts", tuple(normalised))
        if self.control_plane is not None:
            set_(self, "control_plane", _check_listen("control_plane", self.control_plane))
            if self.hosts:
                raise ConfigError(
                    "hosts", self.hosts, "empty when control_plane is set (it supplies the hosts)"
                )
        if not isinstance(self.cluster, str) or not self.cluster:
            raise ConfigError("cluster", self.cluster, "a non-empty cluster name")
        factor = self.balance_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not 1.0 <= factor <= 10
        ):
            raise ConfigError("balance_factor", factor, "a number from 1.0 to 10, or null")
        feed_age = self.load_feed_max_age_s
        if (
            isinstance(feed_age, bool)
            or not isinstance(feed_age, (int, float))
            or not (0.1 <= feed_age <= 600)
        ):
            raise ConfigError("load_feed_max_age_s", feed_age, "a number from 0.1 to 600")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", self.log_level, f"one of {', '.join(LOG_LEVELS)}")


FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
_INT_FIELDS = {
    "prefix_length",
    "concurrency_threshold",
    "failover_hosts",
    "block_bytes",
    "match_depth_chars",
    "index_max_blocks",
    "index_host_tokens",
    "balance_min_in_flight",
}
_FLOAT_FIELDS = {"load_feed_max_age_s", "chars_per_token", "hot_prefix_factor", "overload_cost"}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in _INT_FIELDS:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(name, raw, "an integer") from None
        elif name == "balance_factor":
            try:
                values[name] = None if raw.lower() in ("", "none", "null", "off") else float(raw)
            except ValueError:
                raise ConfigError(name, raw, "a number or off") from None
        elif name in _FLOAT_FIELDS:
            try:
                values[name] = float(raw)
            except ValueError:
                raise ConfigError(name, raw, "a number") from None
        elif name == "hosts":
            values[name] = [h for h in (p.strip() for p in raw.split(",")) if h]
        else:
            values[name] = raw
    return values


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ConfigError on a missing or malformed file."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError("config file", str(path), f"a readable file ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ConfigError("config file", str(path), f"valid YAML ({error})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError("config file", str(path), "a YAML mapping of field: value")
    return loaded


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update(_from_env(os.environ if env is None else env))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(unknown[0], values[unknown[0]], f"a known field: {', '.join(FIELDS)}")
    if isinstance(values.get("hosts"), list):
        values["hosts"] = tuple(values["hosts"])
    return RouterConfig(**values)
