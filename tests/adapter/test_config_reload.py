"""Hot reload of the router's config file through ConfigReloader.check()."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from extproc.adapter.routing import Router
from extproc.adapter.service import ConfigReloader
from extproc.config import ENV_PREFIX, load_config
from extproc.picker.decide import Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.keys import KeyMode
from extproc.stack.processes import wait_until_async

A = "127.0.0.28:8000"
B = "127.0.0.29:8000"
C = "127.0.0.30:8000"
BASE: dict[str, Any] = {
    "routing_strategy": "PREFIX_AWARE",
    "concurrency_threshold": 8,
    "hosts": [A, B],
    "listen": "127.0.0.1:50061",
    "metrics_listen": "127.0.0.1:9162",
}


def reloads(result: str) -> float:
    return REGISTRY.get_sample_value("prefix_router_config_reloads_total", {"result": result}) or 0


def write(path: Path, values: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(values))
    os.replace(temporary, path)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reloader reads the real environment; keep the developer's settings out of it.
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def start(
    tmp_path: Path, values: dict[str, Any], overrides: dict[str, Any] | None = None
) -> tuple[Router, ConfigReloader, Path]:
    path = tmp_path / "router.yaml"
    write(path, values)
    router = Router(load_config(path, overrides=overrides))
    return router, ConfigReloader(router, path, overrides or {}), path


def test_unchanged_file_is_not_reloaded(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    config = router.config
    applied = reloads("applied")
    assert reloader.check() is False
    path.touch()
    assert reloader.check() is False
    assert router.config is config
    assert reloads("applied") == applied


def test_changed_strategy_and_threshold_are_applied(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    applied = reloads("applied")
    write(
        path, {**BASE, "routing_strategy": "LEAST_OUTSTANDING_REQUESTS", "concurrency_threshold": 3}
    )
    assert reloader.check() is True
    assert router.config.routing_strategy is Strategy.LEAST_OUTSTANDING_REQUESTS
    assert router.config.concurrency_threshold == 3
    assert reloads("applied") == applied + 1
    # The next decision uses the new strategy.
    decision = router.route({}, b'{"model":"m","prompt":"hello"}')
    router.finish(decision)
    assert decision.strategy is Strategy.LEAST_OUTSTANDING_REQUESTS
    assert reloader.check() is False  # once per change


@pytest.mark.parametrize(
    "bad",
    [
        {"concurrency_threshold": 0},
        {"routing_strategy": "ROUND_ROBIN"},
        {"hosts": ["vllm-1:8000"]},
        {"unknown_field": 1},
    ],
    ids=["threshold", "strategy", "host", "unknown"],
)
def test_invalid_edit_is_rejected_and_the_old_config_kept(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    router, reloader, path = start(tmp_path, BASE)
    config, hosts = router.config, router.hosts
    rejected, applied = reloads("rejected"), reloads("applied")
    write(path, {**BASE, **bad})
    assert reloader.check() is False
    assert router.config is config
    assert router.hosts is hosts
    assert reloads("rejected") == rejected + 1
    assert reloads("applied") == applied
    # Fixing the file applies it.
    write(path, {**BASE, "concurrency_threshold": 5})
    assert reloader.check() is True
    assert router.config.concurrency_threshold == 5


def test_malformed_yaml_is_rejected(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    config = router.config
    rejected = reloads("rejected")
    path.write_text("routing_strategy: [unclosed\n")
    assert reloader.check() is False
    assert router.config is config
    assert reloads("rejected") == rejected + 1


def test_other_runtime_fields_are_applied(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    write(
        path,
        {
            **BASE,
            "prefix_length": 2048,
            "key_mode": "native",
            "failover_hosts": 0,
            "load_feed_max_age_s": 5.5,
        },
    )
    assert reloader.check() is True
    assert router.config.prefix_length == 2048
    assert router.config.key_mode is KeyMode.NATIVE
    assert router.config.failover_hosts == 0
    assert router.config.load_feed_max_age_s == 5.5
    decision = router.route({}, b'{"model":"m","prompt":"hello"}')
    router.finish(decision)
    assert len(decision.targets) == 1  # no failover hosts any more


def test_listen_is_kept_when_the_file_changes_it(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    write(
        path,
        {
            **BASE,
            "listen": "127.0.0.1:50999",
            "metrics_listen": "127.0.0.1:9999",
            "cluster": "other",
            "concurrency_threshold": 2,
        },
    )
    assert reloader.check() is True
    assert router.config.listen == BASE["listen"]
    assert router.config.metrics_listen == BASE["metrics_listen"]
    assert router.config.cluster == "vllm"
    assert router.config.concurrency_threshold == 2


def test_static_hosts_change_is_applied(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    write(path, {**BASE, "hosts": [B, C]})
    assert reloader.check() is True
    assert router.hosts.addresses == frozenset({B, C})
    assert router.config.hosts == (B, C)


def test_overrides_stay_in_force(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE, overrides={"concurrency_threshold": 7})
    assert router.config.concurrency_threshold == 7
    write(path, {**BASE, "concurrency_threshold": 20, "routing_strategy": "RANDOM"})
    assert reloader.check() is True
    assert router.config.concurrency_threshold == 7
    assert router.config.routing_strategy is Strategy.RANDOM


def test_control_plane_hosts_are_not_touched_by_a_reload(tmp_path: Path) -> None:
    values = {**BASE, "hosts": [], "control_plane": "127.0.0.1:18000"}
    router, reloader, path = start(tmp_path, values)
    published = HostSet.of([C])
    router.set_hosts(published)
    write(path, {**values, "concurrency_threshold": 4})
    assert reloader.check() is True
    assert router.hosts is published
    assert router.config.control_plane == "127.0.0.1:18000"


@contextlib.asynccontextmanager
async def reloading(reloader: ConfigReloader) -> AsyncIterator[None]:
    """The reloader's loop, checking every 20 ms, until the block ends (then stopped)."""
    stop = asyncio.Event()
    task = asyncio.create_task(reloader.run(stop, interval_s=0.02))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)


async def test_run_applies_a_change(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    async with reloading(reloader):
        write(path, {**BASE, "concurrency_threshold": 11})
        await wait_until_async(
            lambda: router.config.concurrency_threshold == 11,
            5,
            "the new threshold applied",
            interval_s=0.02,
        )


def test_switching_to_a_control_plane_keeps_the_static_hosts(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    write(path, {**BASE, "hosts": [], "control_plane": "127.0.0.1:18000"})
    reloader.check()
    assert router.config.control_plane is None
    assert router.hosts.addresses == frozenset({A, B})


def test_dropping_the_control_plane_needs_a_restart_and_keeps_it(tmp_path: Path) -> None:
    values = {**BASE, "hosts": [], "control_plane": "127.0.0.1:18000"}
    router, reloader, path = start(tmp_path, values)
    write(path, {**BASE, "hosts": [A], "concurrency_threshold": 13})
    # The other fields apply; the host source (control plane vs static) waits for a restart.
    assert reloader.check() is True
    assert router.config.control_plane == "127.0.0.1:18000"
    assert router.config.hosts == ()
    assert router.config.concurrency_threshold == 13
    assert router.hosts.addresses == frozenset()


def test_a_file_nested_too_deeply_is_rejected_naming_the_file(tmp_path: Path) -> None:
    router, reloader, path = start(tmp_path, BASE)
    config, rejected = router.config, reloads("rejected")
    path.write_text("hosts: " + "[" * 20000 + "]" * 20000 + "\n")
    assert reloader.check() is False
    assert router.config is config
    assert reloads("rejected") == rejected + 1


def test_an_unexpected_error_in_a_reload_keeps_the_old_config_and_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router, reloader, path = start(tmp_path, BASE)
    config, hosts, failed = router.config, router.hosts, reloads("failed")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug in the loader")

    # A fault injected where no real input reaches today: any bug in a reload.
    monkeypatch.setattr("extproc.adapter.service.load_config", broken)
    write(path, {**BASE, "concurrency_threshold": 3})
    assert reloader.check() is False
    assert router.config is config and router.hosts is hosts
    assert reloads("failed") == failed + 1
    # The watch goes on: the next edit, once loading works again, is applied.
    monkeypatch.setattr("extproc.adapter.service.load_config", load_config)
    write(path, {**BASE, "concurrency_threshold": 4})
    assert reloader.check() is True
    assert router.config.concurrency_threshold == 4


async def test_the_reload_task_outlives_an_unexpected_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router, reloader, path = start(tmp_path, BASE)
    calls = 0

    def broken_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the loader")
        return load_config(*args, **kwargs)

    monkeypatch.setattr("extproc.adapter.service.load_config", broken_once)
    async with reloading(reloader):
        write(path, {**BASE, "concurrency_threshold": 3})
        await wait_until_async(lambda: calls, 2, "the broken load", interval_s=0.02)
        write(path, {**BASE, "concurrency_threshold": 5})
        await wait_until_async(
            lambda: router.config.concurrency_threshold == 5,
            2,
            "the next good reload",
            interval_s=0.02,
        )
    assert calls >= 2 and router.config.concurrency_threshold == 5
