from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.control.config import (
    ControlPlaneConfig,
    HealthSettings,
    LoadFeedSettings,
    load_control_plane_config,
)
from extproc.errors import ConfigError


def write(tmp_path: Path, values: Any) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_defaults_are_valid_and_frozen() -> None:
    config = ControlPlaneConfig()
    assert config.listen == "127.0.0.1:18000"
    assert config.cluster == "vllm"
    assert config.hosts == ()
    assert config.health == HealthSettings()
    assert config.load_feed == LoadFeedSettings()
    assert config.health.timeout_s <= config.health.interval_s
    assert config.load_feed.timeout_s <= config.load_feed.interval_s
    with pytest.raises(AttributeError):
        config.cluster = "other"  # type: ignore[misc]


def test_no_file_gives_the_defaults() -> None:
    assert load_control_plane_config(None) == ControlPlaneConfig()


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_control_plane_config(path) == ControlPlaneConfig()


def test_file_values_are_normalised(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "listen": " 127.0.0.5:018000 ",
            "cluster": "pool",
            "hosts": ["127.0.0.1:08000", "[::1]:8001"],
            "draining": ["127.0.0.1:8000"],
            "zones": {"127.0.0.1:08000": "z1", "[0:0::1]:8001": "z2"},
            "dns": ["vllm.internal:8000"],
            "health": {"interval_s": 2, "timeout_s": 1, "healthy_threshold": 3},
            "load_feed": {"interval_s": 0.5},
        },
    )
    config = load_control_plane_config(path)
    assert config.listen == "127.0.0.5:18000"
    assert config.cluster == "pool"
    assert config.hosts == ("127.0.0.1:8000", "[::1]:8001")
    assert config.draining == ("127.0.0.1:8000",)
    assert config.zones == {"127.0.0.1:8000": "z1", "[::1]:8001": "z2"}
    assert config.dns == ("vllm.internal:8000",)
    assert config.health == HealthSettings(interval_s=2, timeout_s=1, healthy_threshold=3)
    assert isinstance(config.health.interval_s, int | float)
    assert config.load_feed == LoadFeedSettings(interval_s=0.5, timeout_s=0.2)


def test_overrides_win_and_none_is_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, {"cluster": "from-file", "listen": "127.0.0.1:1000"})
    config = load_control_plane_config(path, {"cluster": "from-flag", "listen": None})
    assert config.cluster == "from-flag"
    assert config.listen == "127.0.0.1:1000"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"health": {"interval_s": 0}}, "health.interval_s"),
        ({"health": {"interval_s": 301}}, "health.interval_s"),
        ({"health": {"interval_s": "fast"}}, "health.interval_s"),
        ({"health": {"interval_s": True}}, "health.interval_s"),
        ({"health": {"interval_s": 1, "timeout_s": 2}}, "health.timeout_s"),
        ({"health": {"unhealthy_threshold": 0}}, "health.unhealthy_threshold"),
        ({"health": {"healthy_threshold": 1.5}}, "health.healthy_threshold"),
        ({"health": {"interval": 1}}, "health.interval"),
        ({"health": [1, 2]}, "health"),
        ({"load_feed": {"interval_s": 0.1, "timeout_s": 0.2}}, "load_feed.timeout_s"),
        ({"load_feed": {"interval_s": 0.01}}, "load_feed.interval_s"),
        ({"load_feed": {"bogus": 1}}, "load_feed.bogus"),
        ({"load_feed": "often"}, "load_feed"),
        ({"hosts": ["127.0.0.1:8000", "vllm-1:8000"]}, "hosts[1]"),
        ({"hosts": ["127.0.0.1:8000", "127.0.0.2:0"]}, "hosts[1]"),
        ({"hosts": "127.0.0.1:8000"}, "hosts"),
        ({"draining": ["nope"]}, "draining[0]"),
        ({"listen": "anywhere"}, "listen"),
        ({"metrics_listen": "127.0.0.1"}, "metrics_listen"),
        ({"cluster": ""}, "cluster"),
        ({"cluster": 5}, "cluster"),
        ({"dns": "vllm:8000"}, "dns"),
        ({"dns": ["no-port"]}, "dns[0]"),
        ({"dns": ["a:1", "b:99999"]}, "dns[1]"),
        ({"zones": ["a"]}, "zones"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_errors_name_the_field(tmp_path: Path, values: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_control_plane_config(write(tmp_path, values))
    assert caught.value.field == field
    assert field in str(caught.value)


def test_unknown_field_error_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_control_plane_config(write(tmp_path, {"hosts": [], "helth": {}}))
    assert caught.value.field == "helth"
    assert "health" in caught.value.allowed
    assert "load_feed" in caught.value.allowed


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(ConfigError) as caught:
        load_control_plane_config(None, {"bogus": 1})
    assert caught.value.field == "bogus"


def test_malformed_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("hosts: [unclosed\n")
    with pytest.raises(ConfigError):
        load_control_plane_config(path)
    with pytest.raises(ConfigError):
        load_control_plane_config(tmp_path / "missing.yaml")


def test_bad_zone_address_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_control_plane_config(write(tmp_path, {"zones": {"vllm-1:8000": "z1"}}))
    assert caught.value.field.startswith("zones")


@pytest.mark.parametrize("entry", ["vllm.internal:http", "vllm.internal:0", ":8000"])
def test_bad_dns_port_is_a_config_error(tmp_path: Path, entry: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_control_plane_config(write(tmp_path, {"dns": [entry]}))
    assert caught.value.field.startswith("dns")
