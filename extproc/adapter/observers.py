"""What watches the router's decisions without taking part in them.

The Router (``routing.py``) decides; its observers are told what it decided (a ``Routed``
record per request), when a request moves to another host or ends, when the host set or
a host's cache changes, when the config is reloaded, and when the router stops. They answer
nothing, so none can change a decision. The Router holds ``LiveShares``, those ``configured``
builds from its config (again on each hot reload) and any its caller gives it; it does not
know what any of them is.

- ``LiveShares``: the live decisions per host since start
  (``prefix_router_routed_requests_total``), the share shadow mode's is set against;
- ``TrafficLogObserver``: one traffic-log record per request (``traffic_log.py``);
- ``ShadowObserver``: shadow mode, where PREFIX_AWARE would have sent each request
  (``shadow_worker.py``'s thread, over ``index/shadow.py``'s model).

Every call comes on the router's thread (the event loop's) and must not block: what costs
(hashing the chain, writing, placing), an observer queues for its own thread.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple, Protocol

from extproc.adapter.settings import index_sizing, load_policy, pending_prefill_rate
from extproc.adapter.shadow_worker import ShadowWorker
from extproc.adapter.traffic_log import TrafficLog
from extproc.config import RouterConfig
from extproc.index.shadow import Shadow
from extproc.picker.blocks import PromptBlocks
from extproc.picker.decide import Decision
from extproc.picker.hosts import HostSet


class Routed(NamedTuple):
    """One request as the router decided it: what its observers are told."""

    decision: Decision
    # The hosts it could go to (those serving its model), and the placement weights read
    # (empty where neither the strategy nor an observer reads them).
    hosts: HostSet
    weights: Mapping[str, float]
    # The router's clock when it decided.
    now: float
    # The prompt's block chain, or a callable that hashes it when first called (in the
    # observer's own thread, once for all of them); None where no observer reads the prompt.
    chain: PromptBlocks | Callable[[], PromptBlocks] | None
    model: str | None
    salt: str | None
    # (digest, prefix_length) of the fixed-length key, where the router computed it.
    fixed: tuple[int, int] | None


class RouteObserver(Protocol):
    """Told what the router does; answers nothing."""

    @property
    def name(self) -> str: ...

    @property
    def reads_prompt(self) -> bool:
        """Whether it reads ``Routed.chain`` (the router then reads the prompt as deep as
        matching goes, whatever its strategy)."""
        ...

    @property
    def reads_weights(self) -> bool:
        """Whether it reads ``Routed.weights`` (the router then reads them whatever its
        strategy)."""
        ...

    def routed(self, request: Routed) -> None:
        """A request was decided; called after the decision is counted in flight."""

    def moved(self, decision: Decision, to: Decision) -> None:
        """The request of ``decision`` was served elsewhere: ``to`` stands for it now."""

    def ended(self, decision: Decision) -> None:
        """The request ended, or its stream closed first (its end is then not known)."""

    def hosts_changed(self, hosts: frozenset[str]) -> None:
        """A new host set (and, for one just built on a reload, the current one)."""

    def host_reset(self, host: str) -> None:
        """``host``'s engine restarted: its cache is empty."""

    def cache_sizes(self, tokens: Mapping[str, float]) -> None:
        """Each host's KV cache, in tokens, from the load feed."""

    def applies_to(self, config: RouterConfig) -> bool:
        """Whether it is, as it stands, what a reloaded ``config`` asks for; False: the
        router stops it, and builds what the config asks for anew."""
        ...

    def stop(self) -> None:
        """The router stops, or a reload turned it off: end its thread, close its files."""


class Observer:
    """What an observer ignores, it need not write: every call does nothing here."""

    name = "observer"
    reads_prompt = False
    reads_weights = False

    def routed(self, request: Routed) -> None:
        pass

    def moved(self, decision: Decision, to: Decision) -> None:
        pass

    def ended(self, decision: Decision) -> None:
        pass

    def hosts_changed(self, hosts: frozenset[str]) -> None:
        pass

    def host_reset(self, host: str) -> None:
        pass

    def cache_sizes(self, tokens: Mapping[str, float]) -> None:
        pass

    def applies_to(self, config: RouterConfig) -> bool:
        return True

    def stop(self) -> None:
        pass


class LiveShares(Observer):
    """The live decisions per host since the router started, moved with a request served
    elsewhere; a host that leaves the fleet loses its count."""

    name = "live"

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def routed(self, request: Routed) -> None:
        self.counts[request.decision.primary] += 1

    def moved(self, decision: Decision, to: Decision) -> None:
        self.counts[decision.primary] -= 1
        self.counts[to.primary] += 1

    def hosts_changed(self, hosts: frozenset[str]) -> None:
        for host in [h for h in self.counts if h not in hosts]:
            del self.counts[host]


def _log_settings(config: RouterConfig) -> tuple[object, ...]:
    return (config.traffic_log, config.traffic_log_max_bytes, config.traffic_log_files)


class TrafficLogObserver(Observer):
    """Writes each request's record to a traffic log (``traffic_log.py``). One built from
    the config (``configured``) is replaced when its settings change; one the caller opened
    is kept whatever the config says. Stopping it writes what is queued and closes it."""

    name = "traffic_log"
    reads_prompt = True

    def __init__(self, log: TrafficLog, settings: tuple[object, ...] | None = None) -> None:
        self.log = log
        self._settings = settings

    @classmethod
    def configured(cls, config: RouterConfig) -> TrafficLogObserver | None:
        if config.traffic_log is None:
            return None
        log = TrafficLog(
            Path(config.traffic_log), config.traffic_log_max_bytes, config.traffic_log_files
        )
        return cls(log, _log_settings(config))

    def routed(self, request: Routed) -> None:
        if request.chain is not None:
            self.log.write(request.chain, request.model, request.salt, request.fixed)

    def applies_to(self, config: RouterConfig) -> bool:
        return self._settings is None or self._settings == _log_settings(config)

    def stop(self) -> None:
        self.log.close()


def _shadow_settings(config: RouterConfig) -> tuple[object, ...]:
    """What the shadow's model depends on: when one of these changes, it starts afresh."""
    return (
        config.key_mode,
        config.block_bytes,
        config.match_depth_chars,
        load_policy(config),
        config.hot_prefix_factor,
        pending_prefill_rate(config),
    )


class ShadowObserver(Observer):
    """Shadow mode: each request placed as PREFIX_AWARE would, in its own thread
    (``ShadowWorker``), and counted on its shadow host until it ends.

    The worker knows a request by a number from ``_tokens``, kept here beside its decision
    until the request ends, and found by the decision's id(): the decision is held here, so
    no other object can take that id meanwhile. A decision moved to another host hands its
    number on to the one that stands for it."""

    name = "shadow"
    reads_prompt = True
    reads_weights = True

    def __init__(self, config: RouterConfig) -> None:
        self._settings = _shadow_settings(config)
        self.worker = ShadowWorker(
            Shadow(
                index_sizing(config),
                load_policy(config),
                config.hot_prefix_factor,
                pending_prefill_rate(config),
            )
        )
        self._tokens = itertools.count()
        self._shadowed: dict[int, tuple[Decision, int]] = {}

    @classmethod
    def configured(cls, config: RouterConfig) -> ShadowObserver | None:
        return cls(config) if config.shadow else None

    @property
    def predictions(self) -> Shadow:
        """The shadow's counters since it started, as its thread has left them."""
        return self.worker.shadow

    @property
    def requests(self) -> int:
        """Requests shadowed and not yet ended (as the router has told it)."""
        return len(self._shadowed)

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until its thread has applied everything told so far."""
        self.worker.sync(timeout)

    def routed(self, request: Routed) -> None:
        if request.chain is None:
            return
        token = next(self._tokens)
        self._shadowed[id(request.decision)] = (request.decision, token)
        self.worker.place(token, request.chain, request.hosts, request.weights, request.now)

    def moved(self, decision: Decision, to: Decision) -> None:
        shadowed = self._shadowed.pop(id(decision), None)
        if shadowed is not None:
            self._shadowed[id(to)] = (to, shadowed[1])

    def ended(self, decision: Decision) -> None:
        shadowed = self._shadowed.pop(id(decision), None)
        if shadowed is not None:
            self.worker.release(shadowed[1])

    def hosts_changed(self, hosts: frozenset[str]) -> None:
        self.worker.retain(hosts)

    def host_reset(self, host: str) -> None:
        self.worker.forget(host)

    def cache_sizes(self, tokens: Mapping[str, float]) -> None:
        self.worker.set_cache_sizes(tokens)

    def applies_to(self, config: RouterConfig) -> bool:
        return config.shadow and self._settings == _shadow_settings(config)

    def stop(self) -> None:
        self.worker.stop()
        self._shadowed.clear()


# What a config may ask for, in the order the router tells them.
_CONFIGURED: tuple[tuple[type[Observer], Callable[[RouterConfig], Observer | None]], ...] = (
    (TrafficLogObserver, TrafficLogObserver.configured),
    (ShadowObserver, ShadowObserver.configured),
)


def configured(
    config: RouterConfig, current: Iterable[RouteObserver] = ()
) -> tuple[RouteObserver, ...]:
    """The observers ``config`` asks for. One of ``current`` that still applies is kept as
    it is (shadow mode keeps its model while its settings stay); the others are stopped, and
    what the config asks for is built anew. The caller tells those it did not hold before
    the host set and the cache sizes."""
    held = tuple(current)
    chosen: list[RouteObserver] = []
    for kind, build in _CONFIGURED:
        old = next((o for o in held if type(o) is kind), None)
        if old is not None and old.applies_to(config):
            chosen.append(old)
            continue
        if old is not None:
            old.stop()
        new = build(config)
        if new is not None:
            chosen.append(new)
    return tuple(chosen)


def shadow_predictions(observers: Iterable[RouteObserver]) -> Shadow | None:
    """Shadow mode's counters, where one of ``observers`` is shadow mode."""
    shadow = next((o for o in observers if isinstance(o, ShadowObserver)), None)
    return None if shadow is None else shadow.predictions
