"""Active health checking of vLLM hosts.

The core (`next_health`) is a pure state transition; `probe` is the HTTP adapter and
`HealthChecker` runs rounds of probes and reports when the published view changes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import httpx
import structlog

from extproc.control import metrics
from extproc.control.model import HostHealth
from extproc.control.rounds import sleep_unless_stopped
from extproc.http_client import host_client

log = structlog.get_logger("health")

# Probe error texts go into logs and HostHealth; keep them one short line.
_MAX_ERROR_CHARS = 200


@dataclass(frozen=True)
class HealthPolicy:
    """How often hosts are probed and how many results flip their state."""

    interval_s: float = 1.0
    timeout_s: float = 0.5
    # Consecutive failures that eject a healthy host.
    unhealthy_threshold: int = 2
    # Consecutive successes that admit a new or ejected host.
    healthy_threshold: int = 2

    def __post_init__(self) -> None:
        _check_positive_seconds("interval_s", self.interval_s)
        _check_positive_seconds("timeout_s", self.timeout_s)
        if self.timeout_s > self.interval_s:
            raise ValueError(
                f"timeout_s={self.timeout_s!r}: allowed (0, interval_s={self.interval_s!r}]"
            )
        _check_count("unhealthy_threshold", self.unhealthy_threshold)
        _check_count("healthy_threshold", self.healthy_threshold)


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one probe of one host."""

    ok: bool
    # None: /health answered but the model listing did not, so the models are unknown.
    models: tuple[str, ...] | None = ()
    error: str | None = None


def next_health(previous: HostHealth, probe: ProbeResult, policy: HealthPolicy) -> HostHealth:
    """The host's state after one more probe; a never-seen host starts as HostHealth()."""
    if probe.ok:
        successes = previous.consecutive_successes + 1
        return HostHealth(
            healthy=previous.healthy or successes >= policy.healthy_threshold,
            consecutive_failures=0,
            consecutive_successes=successes,
            # A listing that failed once must not strip a serving host of its models.
            models=previous.models if probe.models is None else probe.models,
            last_error=None,
        )
    failures = previous.consecutive_failures + 1
    return HostHealth(
        healthy=previous.healthy and failures < policy.unhealthy_threshold,
        consecutive_failures=failures,
        consecutive_successes=0,
        # The last known models stay, so a readmitted host is routable at once.
        models=previous.models,
        last_error=probe.error if probe.error is not None else "probe failed",
    )


def hold_when_every_host_fails(
    previous: Mapping[str, HostHealth], current: dict[str, HostHealth]
) -> tuple[dict[str, HostHealth], list[str]]:
    """Fail static: a round that would leave no host healthy keeps the hosts that were.

    Every host failing in the same round is more often the prober (its CPU starved, its
    network cut) than the whole fleet, and publishing the set of none would have Envoy
    answer every request 503 "no healthy upstream". Envoy's own panic threshold makes the
    same call. A fleet that is really down fails its requests either way; the held hosts
    keep counting failures, so once any probe passes again those still failing are
    ejected by the next round. Returns the states to keep and the addresses held.
    """
    if any(state.healthy for state in current.values()):
        return current, []
    held = sorted(a for a in current if previous.get(a, HostHealth()).healthy)
    if not held:
        return current, []
    kept = dict(current)
    for address in held:
        kept[address] = replace(current[address], healthy=True)
    return kept, held


def models_from_listing(listing: object) -> tuple[str, ...]:
    """Model ids from an OpenAI /v1/models body, sorted so that order never looks like change.

    vLLM lists LoRA adapters there too (their `parent` names the base model); both are
    servable model names, so both are kept. Raises ValueError on a body of another shape.
    """
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        raise ValueError("/v1/models body has no 'data' list")
    ids = set()
    for entry in listing["data"]:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"/v1/models entry without a string id: {entry!r}")
        ids.add(model_id)
    return tuple(sorted(ids))


async def probe(client: httpx.AsyncClient, address: str, timeout_s: float) -> ProbeResult:
    """GET /health (must be 2xx), then /v1/models for the served models. Never raises.

    Both requests share one `timeout_s` budget, so a round never outlasts the interval.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            health = await client.get(f"http://{address}/health")
    except (TimeoutError, httpx.TimeoutException):
        return ProbeResult(False, error=f"/health timed out after {timeout_s} s")
    except Exception as exc:  # httpx.HTTPError, InvalidURL: the host failed its probe
        return ProbeResult(False, error=_describe(exc))
    if not health.is_success:
        return ProbeResult(False, error=f"/health answered HTTP {health.status_code}")
    try:
        async with asyncio.timeout_at(deadline):
            listing = await client.get(f"http://{address}/v1/models")
        models = models_from_listing(listing.raise_for_status().json())
    except Exception as exc:
        # /health is the liveness signal; a host without a model listing still serves.
        log.debug("health.models_unavailable", address=address, error=_describe(exc))
        return ProbeResult(True, models=None)
    return ProbeResult(True, models=models)


class HealthChecker:
    """Probes a changing list of hosts in rounds and keeps each host's HostHealth."""

    def __init__(
        self,
        policy: HealthPolicy,
        client_factory: Callable[[], httpx.AsyncClient] = host_client,
    ) -> None:
        self._policy = policy
        self._client_factory = client_factory
        self._states: dict[str, HostHealth] = {}
        # Hosts the last round kept healthy although every probe failed (fail static).
        self._held: list[str] = []
        # Open only while run() is; check_once() alone uses a client per round.
        self._client: httpx.AsyncClient | None = None

    @property
    def states(self) -> Mapping[str, HostHealth]:
        return MappingProxyType(dict(self._states))

    async def check_once(self, addresses: Iterable[str]) -> Mapping[str, HostHealth]:
        """Probe every address concurrently; hosts no longer listed are forgotten."""
        if self._client is not None:
            return await self._check_with(self._client, addresses)
        async with self._client_factory() as client:
            return await self._check_with(client, addresses)

    async def run(
        self,
        addresses: Callable[[], Iterable[str]],
        on_change: Callable[[Mapping[str, HostHealth]], None],
        stop: asyncio.Event,
    ) -> None:
        """Check every `interval_s` until `stop` is set.

        `on_change` gets the states after round `healthy_threshold` and then whenever the
        healthy set or a healthy host's models change: unhealthy hosts are never published,
        so their counters and models moving is not news. Before that round no host could
        have passed enough probes: every host is unknown, not unhealthy, and publishing
        the set of none would have Envoy and the routers, which keep their last set until
        a control plane that restarted publishes, drop the whole fleet for a round.
        """
        loop = asyncio.get_running_loop()
        published: dict[str, tuple[str, ...]] | None = None
        rounds = 0
        async with self._client_factory() as client:
            self._client = client
            try:
                while not stop.is_set():
                    round_started = loop.time()
                    # A round is bounded by timeout_s, so stop waits at most that long.
                    states = await self._check_with(client, addresses())
                    rounds += 1
                    view = _published_view(states)
                    if rounds >= self._policy.healthy_threshold and view != published:
                        published = view
                        on_change(states)
                    remaining = self._policy.interval_s - (loop.time() - round_started)
                    await sleep_unless_stopped(remaining, stop)
            finally:
                self._client = None

    async def _check_with(
        self, client: httpx.AsyncClient, addresses: Iterable[str]
    ) -> Mapping[str, HostHealth]:
        listed = list(dict.fromkeys(addresses))
        results = await asyncio.gather(
            *(probe(client, address, self._policy.timeout_s) for address in listed)
        )
        states: dict[str, HostHealth] = {}
        for address, result in zip(listed, results, strict=True):
            states[address] = next_health(
                self._states.get(address, HostHealth()), result, self._policy
            )
        states, held = hold_when_every_host_fails(self._states, states)
        if held:
            metrics.CP_HEALTH_HOLDS.inc()
        if held and held != self._held:  # once per episode, not once a round
            log.warning(
                "health.every_host_failed",
                held=held,
                reasons=sorted({s.last_error or "probe failed" for s in states.values()}),
            )
        self._held = held
        for address, after in states.items():
            _log_transition(address, self._states.get(address, HostHealth()), after)
        self._states = states
        return self.states


def _published_view(states: Mapping[str, HostHealth]) -> dict[str, tuple[str, ...]]:
    return {address: state.models for address, state in states.items() if state.healthy}


def _log_transition(address: str, before: HostHealth, after: HostHealth) -> None:
    if before.healthy and not after.healthy:
        log.warning(
            "host.ejected",
            address=address,
            reason=after.last_error,
            consecutive_failures=after.consecutive_failures,
        )
    elif after.healthy and not before.healthy:
        log.info(
            "host.admitted",
            address=address,
            reason=f"{after.consecutive_successes} consecutive successful probes",
            models=list(after.models),
        )


def _describe(exc: BaseException) -> str:
    # The first line only: httpx's status errors add a second, a link to the status's page.
    message = str(exc).partition("\n")[0]
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text[:_MAX_ERROR_CHARS]


def _check_positive_seconds(field: str, value: float) -> None:
    valid = isinstance(value, int | float) and not isinstance(value, bool)
    if not valid or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}={value!r}: allowed a finite number of seconds > 0")


def _check_count(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}={value!r}: allowed an integer >= 1")
