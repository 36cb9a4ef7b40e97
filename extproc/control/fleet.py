"""The control plane's loops: discovery, health checks and load scrapes feed snapshots.

Producers (discovery, the health checker, the load scraper) write immutable records; this
module turns them into snapshots and hands them to the store. It never touches gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import structlog

from extproc import metrics as shared_metrics
from extproc.control import metrics
from extproc.control.config import ControlPlaneConfig, load_control_plane_config
from extproc.control.discovery import Discovery, DnsSource, Source, StaticSource
from extproc.control.health import HealthChecker, HealthPolicy
from extproc.control.loadfeed import LoadFeedPolicy, LoadScraper
from extproc.control.model import HostHealth, HostLoad
from extproc.control.rates import CachePressure
from extproc.control.rounds import sleep_unless_stopped
from extproc.control.snapshot import FleetSnapshot, LoadSnapshot, PublishedHost, SnapshotStore
from extproc.errors import ConfigError
from extproc.filewatch import FileWatcher
from extproc.schema import restart_fields

log = structlog.get_logger("fleet")


# Fields a running control plane cannot change (its addresses, its loops' timing, the TLS
# files it read at start): marked ``restart=True`` where the config declares them.
RESTART_FIELDS = restart_fields(ControlPlaneConfig)


def build_fleet(config: ControlPlaneConfig, states: Mapping[str, HostHealth]) -> FleetSnapshot:
    """The published fleet: healthy hosts, with draining flags, models and zones."""
    draining = set(config.draining)
    hosts = [
        PublishedHost(address, address in draining, state.models, config.zones.get(address, ""))
        for address, state in states.items()
        if state.healthy
    ]
    return FleetSnapshot.build(config.cluster, hosts)


def sources_for(config: ControlPlaneConfig) -> list[Source]:
    sources: list[Source] = [StaticSource(config.hosts)]
    if config.dns:
        sources.append(DnsSource(config.dns))
    return sources


class Fleet:
    def __init__(
        self,
        config: ControlPlaneConfig,
        store: SnapshotStore,
        config_path: Path | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self._config_watch = FileWatcher(config_path) if config_path else None
        self._wall_clock = wall_clock
        self._clock = clock
        self._discovery = Discovery(sources_for(config))
        self.addresses: frozenset[str] = frozenset()
        health = config.health
        self.health = HealthChecker(
            HealthPolicy(
                health.interval_s,
                health.timeout_s,
                health.unhealthy_threshold,
                health.healthy_threshold,
            )
        )
        self.scraper = LoadScraper(
            LoadFeedPolicy(config.load_feed.interval_s, config.load_feed.timeout_s)
        )
        self.pressure = CachePressure(
            config.load_feed.rate_time_constant_s, factor=config.load_feed.pressure_factor
        )
        self._pressure_series: set[str] = set()  # hosts with pressure gauges
        # Publish an empty fleet at once, so early subscribers get an answer.
        self.publish_fleet(self.health.states)

    def publish_fleet(self, states: Mapping[str, HostHealth]) -> FleetSnapshot:
        fleet = build_fleet(self.config, states)
        if self.store.publish(fleet):
            metrics.CP_PUBLISHES.labels("fleet").inc()
            metrics.CP_HOSTS.labels("healthy").set(len(fleet.hosts))
            log.info(
                "fleet_published",
                version=fleet.version[:12],
                hosts=[h.address for h in fleet.hosts],
                draining=[h.address for h in fleet.hosts if h.draining],
            )
        return fleet

    def publish_loads(self, loads: Mapping[str, HostLoad]) -> None:
        metrics.CP_SCRAPE_FAILURES.inc(self.scraper.failures - self._counted_failures)
        self._counted_failures = self.scraper.failures
        if not loads:
            return
        # The scrapes' own (monotonic) times measure the rates.
        pressure = self.pressure.update(
            loads, max(load.scraped_at for load in loads.values()), self.healthy_addresses()
        )
        for address, (rate, weight) in pressure.items():
            metrics.CP_PROMPT_RATE.labels(address).set(rate)
            metrics.CP_PLACEMENT_WEIGHT.labels(address).set(weight)
        # Hosts that left the fleet leave no series behind.
        for address in self._pressure_series - set(self.healthy_addresses()):
            metrics.CP_PROMPT_RATE.remove(address)
            metrics.CP_PLACEMENT_WEIGHT.remove(address)
        self._pressure_series = set(pressure) & set(self.healthy_addresses())
        # Each scrape's start in wall time, so the stamp means the same thing in every
        # process that reads it.
        to_wall = self._wall_clock() - self._clock()
        stamped = {
            address: replace(
                load,
                scraped_at=load.scraped_at + to_wall,
                prompt_tokens_per_s=pressure[address][0],
                placement_weight=pressure[address][1],
            )
            for address, load in loads.items()
        }
        if self.store.publish(LoadSnapshot.build(self.config.cluster, stamped)):
            metrics.CP_PUBLISHES.labels("load").inc()

    _counted_failures = 0

    def healthy_addresses(self) -> list[str]:
        return [a for a, state in self.health.states.items() if state.healthy]

    def reload_config(self) -> bool:
        if self._config_watch is None or not self._config_watch.changed():
            return False
        try:
            return self._reload(self._config_watch.path)
        except ConfigError as error:
            shared_metrics.CONFIG_RELOADS.labels("rejected").inc()
            log.error("config_reload_rejected", path=str(self._config_watch.path), error=str(error))
        except Exception:  # a bug, or input nothing anticipated: never the discovery loop
            shared_metrics.CONFIG_RELOADS.labels("failed").inc()
            log.exception("config_reload_failed", path=str(self._config_watch.path))
        return False

    def _reload(self, path: Path) -> bool:
        config = load_control_plane_config(path)
        restart = [
            name for name in RESTART_FIELDS if getattr(config, name) != getattr(self.config, name)
        ]
        if restart:
            log.warning("config_reload_needs_restart", fields=restart)
            config = config.replace(**{name: getattr(self.config, name) for name in restart})
        discovery = Discovery(sources_for(config))  # before anything changes
        self.config, self._discovery = config, discovery
        shared_metrics.CONFIG_RELOADS.labels("applied").inc()
        log.info("config_reloaded", hosts=len(config.hosts), dns=len(config.dns))
        return True

    async def discover(self) -> frozenset[str]:
        """Reload the config if it changed, then refresh the candidate hosts."""
        reloaded = self.reload_config()
        self.addresses = await self._discovery.addresses()
        metrics.CP_HOSTS.labels("discovered").set(len(self.addresses))
        if reloaded:
            # Draining flags, zones or the host list may have changed without any health
            # change: republish at once, without hosts the new config no longer lists.
            current = {a: s for a, s in self.health.states.items() if a in self.addresses}
            self.publish_fleet(current)
        return self.addresses

    async def run(self, stop: asyncio.Event) -> None:
        await self.discover()
        await asyncio.gather(
            self._discovery_loop(stop),
            self.health.run(lambda: self.addresses, self._on_health, stop),
            self.scraper.run(self.healthy_addresses, self.publish_loads, stop),
        )

    def _on_health(self, states: Mapping[str, HostHealth]) -> None:
        previous = set(self.store_fleet_addresses())
        fleet = self.publish_fleet(states)
        metrics.CP_EJECTIONS.inc(len(previous - {h.address for h in fleet.hosts}))

    def store_fleet_addresses(self) -> list[str]:
        fleet = self.store.get(self.config.cluster)
        return [h.address for h in fleet.hosts] if isinstance(fleet, FleetSnapshot) else []

    async def _discovery_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await sleep_unless_stopped(self.config.health.interval_s, stop)
            if stop.is_set():
                return
            try:
                await self.discover()
            except Exception:  # one bad round must not stop discovery
                log.exception("discovery_failed")
