import pytest

from extproc.config import RouterConfig, load_config
from extproc.errors import ConfigError
from extproc.picker.decide import Strategy
from extproc.picker.keys import KeyMode


def test_defaults_are_valid_and_frozen():
    config = RouterConfig()
    assert config.routing_strategy is Strategy.PREFIX_AWARE
    assert config.key_mode is KeyMode.OPENAI
    with pytest.raises(AttributeError):
        config.prefix_length = 2048  # type: ignore[misc]


def test_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(
        "routing_strategy: RANDOM\nprefix_length: 2048\nconcurrency_threshold: 4\n"
        "hosts: ['127.0.0.11:8000', '127.0.0.12:8000']\n"
    )
    env = {"PREFIX_ROUTER_PREFIX_LENGTH": "4096", "PREFIX_ROUTER_KEY_MODE": "native"}
    config = load_config(path, env=env, overrides={"concurrency_threshold": 9, "listen": None})
    assert config.routing_strategy is Strategy.RANDOM
    assert config.prefix_length == 4096
    assert config.key_mode is KeyMode.NATIVE
    assert config.concurrency_threshold == 9
    assert config.hosts == ("127.0.0.11:8000", "127.0.0.12:8000")


def test_env_hosts_are_comma_separated():
    config = load_config(env={"PREFIX_ROUTER_HOSTS": "127.0.0.2:1, 127.0.0.3:1"})
    assert config.hosts == ("127.0.0.2:1", "127.0.0.3:1")


@pytest.mark.parametrize(
    ("settings", "field", "allowed"),
    [
        ({"prefix_length": 1023}, "prefix_length", "1024 to 65536"),
        ({"prefix_length": 65537}, "prefix_length", "1024 to 65536"),
        ({"prefix_length": "big"}, "prefix_length", "1024 to 65536"),
        ({"concurrency_threshold": 0}, "concurrency_threshold", "1 to 1024"),
        ({"concurrency_threshold": 1025}, "concurrency_threshold", "1 to 1024"),
        ({"routing_strategy": "ROUND_ROBIN"}, "routing_strategy", "PREFIX_AWARE"),
        ({"key_mode": "xml"}, "key_mode", "openai"),
        ({"hosts": ["example.com:80"]}, "hosts[0]", "ip:port"),
        ({"listen": "nowhere"}, "listen", "ip:port"),
        ({"workers": 0}, "workers", "1 to 64"),
        ({"workers": 65}, "workers", "1 to 64"),
        ({"event_loop": "trio"}, "event_loop", "uvloop"),
        ({"colour": "red"}, "colour", "a known field"),
    ],
)
def test_errors_name_field_value_and_range(settings, field, allowed):
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides=settings)
    assert caught.value.field == field
    message = str(caught.value)
    assert field in message and allowed in message
    value = next(iter(settings.values()))
    assert repr(value[0] if isinstance(value, list) else value) in message


def test_bad_env_value_names_the_field():
    with pytest.raises(ConfigError, match="concurrency_threshold"):
        load_config(env={"PREFIX_ROUTER_CONCURRENCY_THRESHOLD": "lots"})


def test_malformed_files_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing_strategy: [unclosed")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="readable file"):
        load_config(tmp_path / "missing.yaml", env={})
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy, env={})


def test_replace_validates_again():
    config = RouterConfig()
    assert config.replace(concurrency_threshold=8).concurrency_threshold == 8
    with pytest.raises(ConfigError) as caught:
        config.replace(concurrency_threshold=0)
    assert caught.value.field == "concurrency_threshold"
    assert config.concurrency_threshold == 32  # the original is untouched


def test_env_turns_an_optional_field_off_and_reads_ipv6():
    config = load_config(
        env={"PREFIX_ROUTER_BALANCE_FACTOR": "off", "PREFIX_ROUTER_LISTEN": "[::1]:050051"}
    )
    assert config.balance_factor is None
    assert config.listen == "[::1]:50051"


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"concurrency_threshold": True}, "concurrency_threshold"),
        ({"concurrency_threshold": 4.0}, "concurrency_threshold"),
        ({"chars_per_token": float("inf")}, "chars_per_token"),
        ({"hosts": "127.0.0.1:8000"}, "hosts"),
        ({"control_plane": "127.0.0.1:1", "hosts": ["127.0.0.2:1"]}, "hosts"),
        ({"cluster": ""}, "cluster"),
        ({"log_level": "verbose"}, "log_level"),
    ],
)
def test_no_loose_coercion(settings, field):
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides=settings)
    assert caught.value.field == field


def test_numbers_are_floats_whatever_the_file_wrote(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("chars_per_token: 3\nbalance_factor: 2\n")
    config = load_config(path, env={})
    assert type(config.chars_per_token) is float and type(config.balance_factor) is float


def test_workers_need_a_port_each_for_grpc_and_metrics():
    assert load_config(env={}, overrides={"workers": 4, "listen": "127.0.0.1:65532"}).workers == 4
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides={"workers": 4, "metrics_listen": "127.0.0.1:65533"})
    assert caught.value.field == "workers"
    assert "at most 3 with metrics_listen on port 65533" in str(caught.value)


def test_workers_auto_is_one_per_core_this_process_may_run_on(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert load_config(env={}, overrides={"workers": "auto"}).workers == 3
    assert load_config(env={"PREFIX_ROUTER_WORKERS": "auto"}).workers == 3
    path = tmp_path / "router.yaml"
    path.write_text("workers: auto\n")
    assert load_config(path, env={}).workers == 3
    # More cores than workers may be: the most allowed.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(100)))
    assert load_config(env={}, overrides={"workers": "auto"}).workers == 64
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides={"workers": "many"})
    assert caught.value.field == "workers" and "auto" in str(caught.value)


def test_the_router_listens_on_a_unix_socket_given_by_an_absolute_path():
    config = load_config(env={}, overrides={"listen": "unix:/run/router.sock", "workers": 2})
    assert config.listen == "unix:/run/router.sock"
    for bad, why in (
        ("unix:run/router.sock", "must be absolute"),
        ("unix:/" + "a" * 107, "at most 107 bytes"),
        ("/run/router.sock", "is not ip:port"),
    ):
        with pytest.raises(ConfigError) as caught:
            load_config(env={}, overrides={"listen": bad})
        assert caught.value.field == "listen" and why in str(caught.value), caught.value
    # Worker i listens on the path + .i: the last worker's path must fit too.
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides={"listen": "unix:/" + "a" * 105, "workers": 10})
    assert caught.value.field == "workers" and ".9, over 107 bytes" in str(caught.value)
    # The metrics endpoint is HTTP on a port: a socket there is refused.
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides={"metrics_listen": "unix:/run/metrics.sock"})
    assert caught.value.field == "metrics_listen"


def test_the_drain_timeout_suits_llm_streams_and_is_bounded():
    assert load_config(env={}).drain_timeout_s == 300.0
    assert load_config(env={"PREFIX_ROUTER_DRAIN_TIMEOUT_S": "2.5"}).drain_timeout_s == 2.5
    for bad in (0.5, 3601.0):
        with pytest.raises(ConfigError) as caught:
            load_config(env={}, overrides={"drain_timeout_s": bad})
        assert caught.value.field == "drain_timeout_s"


def test_a_trusted_salt_header_is_a_lower_case_header_name():
    assert load_config(env={}).trusted_salt_header is None
    config = load_config(env={"PREFIX_ROUTER_TRUSTED_SALT_HEADER": "x-tenant-id"})
    assert config.trusted_salt_header == "x-tenant-id"
    for bad in ("X-Tenant-Id", ":authority", "x tenant", ""):
        with pytest.raises(ConfigError) as caught:
            load_config(env={}, overrides={"trusted_salt_header": bad})
        assert caught.value.field == "trusted_salt_header"


@pytest.mark.parametrize(
    ("raw", "value"),
    [("false", False), ("0", False), ("Off", False), ("true", True), ("YES", True), ("1", True)],
)
def test_env_sets_a_true_or_false_field(raw, value):
    # docs/configuration.md lists PREFIX_ROUTER_KV_EVENTS; a string must be able to say it.
    assert load_config(env={"PREFIX_ROUTER_KV_EVENTS": raw}).kv_events is value
    with pytest.raises(ConfigError) as caught:
        load_config(env={"PREFIX_ROUTER_SHADOW": "maybe"})
    assert caught.value.field == "shadow" and "true or false" in str(caught.value)


def test_decision_exchange_endpoints_stay_on_this_machine():
    config = load_config(
        env={
            "PREFIX_ROUTER_DECISION_EXCHANGE_BIND": "tcp://127.0.0.2:05600",
            "PREFIX_ROUTER_DECISION_EXCHANGE_PEERS": "ipc:///run/r/a, tcp://127.0.0.3:5600",
        }
    )
    assert config.decision_exchange_bind == "tcp://127.0.0.2:5600"
    assert config.decision_exchange_peers == ("ipc:///run/r/a", "tcp://127.0.0.3:5600")
    for endpoint in ("tcp://10.0.0.1:5600", "tcp://localhost:5600", "ipc://relative", "inproc://x"):
        with pytest.raises(ConfigError, match="loopback") as error:
            load_config(env={}, overrides={"decision_exchange_peers": [endpoint]})
        assert error.value.field == "decision_exchange_peers[0]"
    with pytest.raises(ConfigError, match="not this one's") as error:
        load_config(
            env={},
            overrides={
                "decision_exchange_bind": "ipc:///run/r/a",
                "decision_exchange_peers": ["ipc:///run/r/a"],
            },
        )
    assert error.value.field == "decision_exchange_peers"
    with pytest.raises(ConfigError, match="supervisor") as error:
        load_config(env={}, overrides={"workers": 2, "decision_exchange_bind": "ipc:///run/r/a"})
    assert error.value.field == "decision_exchange_bind"
    with pytest.raises(ConfigError, match="supervisor") as error:
        load_config(env={}, overrides={"workers": 2, "decision_exchange_peers": ["ipc:///a"]})
    assert error.value.field == "decision_exchange_peers"
    # Workers that share no decisions among themselves may all hear another router's.
    alone = {
        "workers": 2,
        "workers_share_decisions": False,
        "decision_exchange_peers": ["ipc:///a"],
    }
    assert load_config(env={}, overrides=alone).decision_exchange_peers == ("ipc:///a",)
