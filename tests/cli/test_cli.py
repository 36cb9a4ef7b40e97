"""The console script: help text and exit codes, run as a real process, and the flags of
`up`, `router` and `envoy-config` reaching what they configure."""

import dataclasses
import subprocess
import sys

import httpx
import pytest
import yaml

import extproc.cli.envoy_config
from extproc.cli import EXIT_USAGE, main, parse_args
from extproc.cli.common import COMMAND_HELP
from extproc.cli.up import stack_spec
from extproc.picker.decide import Strategy
from extproc.picker.keys import KeyMode
from extproc.stack.bootstrap import BootstrapParams
from extproc.stack.local import LocalStack

BACKENDS = ("127.0.0.21:9000", "127.0.0.22:9001")
BACKEND_PAIRS = (("127.0.0.21", 9000), ("127.0.0.22", 9001))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_command():
    result = run("--help")
    assert result.returncode == 0
    for command in ["up", "router", "sim", "bench", "control-plane", "envoy-config"]:
        assert command in result.stdout
    assert "config-reference" in result.stdout


def test_up_help_documents_every_flag():
    result = run("up", "--help")
    assert result.returncode == 0
    for flag in [
        "--backends",
        "--backend",
        "--listen",
        "--mode",
        "--routing-strategy",
        "--prefix-length",
        "--concurrency-threshold",
        "--key-mode",
        "--no-upstream-host-header",
        "--control-plane",
        "--work-dir",
    ]:
        assert flag in result.stdout


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["up", "--prefix-length", "10"], "prefix_length"),
        (["up", "--concurrency-threshold", "5000"], "concurrency_threshold"),
        (["router", "--prefix-length", "999999", "--listen", "127.0.0.1:1"], "prefix_length"),
        (["router", "--workers", "0", "--listen", "127.0.0.1:1"], "workers"),
        (["up", "--workers", "3", "--router-listen", "127.0.0.1:65534"], "workers"),
        (["epp", "--workers", "65", "--secure-serving=false"], "workers"),
        (["epp", "--workers", "2", "--metrics-port", "9001"], "metrics_listen"),
    ],
)
def test_config_errors_exit_2_naming_the_field(args, field):
    result = run(*args)
    assert result.returncode == 2
    assert field in result.stderr
    assert "allowed" in result.stderr


def bootstrap(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["envoy-config", *flags]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def backend_cluster(config: dict) -> dict:
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "vllm"]
    return cluster


def endpoints(cluster: dict) -> list[tuple[str, int]]:
    (group,) = cluster["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in group["lb_endpoints"]]
    return [(a["address"], a["port_value"]) for a in addresses]


def test_envoy_config_prints_a_bootstrap_with_the_given_backends(capsys):
    flags = [flag for backend in BACKENDS for flag in ("--backend", backend)]
    cluster = backend_cluster(bootstrap(capsys, "--static", *flags))
    assert cluster["type"] == "STATIC"
    assert endpoints(cluster) == list(BACKEND_PAIRS)
    # Without --backend, --static keeps the default fleet; without --static, EDS.
    assert endpoints(backend_cluster(bootstrap(capsys, "--static"))) == [
        ("127.0.0.11", 8000),
        ("127.0.0.12", 8000),
        ("127.0.0.13", 8000),
    ]
    eds = bootstrap(capsys, "--control-plane", "127.0.0.5:18001")
    assert backend_cluster(eds)["type"] == "EDS"
    (xds,) = [c for c in eds["static_resources"]["clusters"] if c["name"] == "xds"]
    assert endpoints(xds) == [("127.0.0.5", 18001)]


def test_envoy_config_closes_idle_backend_connections_before_vllm(capsys):
    def idle_timeout(config: dict) -> str:
        options = backend_cluster(config)["typed_extension_protocol_options"]
        (http,) = options.values()
        return http["common_http_protocol_options"]["idle_timeout"]

    assert idle_timeout(bootstrap(capsys)) == "4s"  # vLLM closes at 5 s
    assert idle_timeout(bootstrap(capsys, "--mode", "original-dst")) == "4s"
    assert idle_timeout(bootstrap(capsys, "--backend-idle-timeout-s", "1.5")) == "1.5s"
    assert main(["envoy-config", "--backend-idle-timeout-s", "0"]) == EXIT_USAGE
    assert "--backend-idle-timeout-s must be 0.1-3600, got 0" in capsys.readouterr().err


def test_envoy_config_lists_every_router_worker_as_an_endpoint(capsys):
    routers = ("--router", "127.0.0.1:6000", "--router", "127.0.0.2:7000")
    config = bootstrap(capsys, *routers, "--router-workers", "2", "--body-mode", "streamed")
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "prefix_router"]
    assert endpoints(cluster) == [
        ("127.0.0.1", 6000), ("127.0.0.1", 6001), ("127.0.0.2", 7000), ("127.0.0.2", 7001)
    ]  # fmt: skip
    # Streamed bodies: one completion log per worker, so each sees its own requests end.
    logs = [c for c in config["static_resources"]["clusters"] if "completions" in c["name"]]
    assert len(logs) == 4
    assert main(["envoy-config", "--router-workers", "65"]) == EXIT_USAGE
    assert "--router-workers must be 1-64" in capsys.readouterr().err


def test_envoy_config_takes_routers_on_unix_sockets(capsys):
    routers = ("--router", "unix:/run/r.sock", "--router", "127.0.0.1:6000")
    config = bootstrap(capsys, *routers, "--router-workers", "2")
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "prefix_router"]
    (group,) = cluster["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"] for e in group["lb_endpoints"]]
    assert addresses == [
        {"pipe": {"path": "/run/r.sock"}},
        {"pipe": {"path": "/run/r.sock.1"}},
        {"socket_address": {"address": "127.0.0.1", "port_value": 6000}},
        {"socket_address": {"address": "127.0.0.1", "port_value": 6001}},
    ]
    with pytest.raises(SystemExit) as exit_:
        main(["envoy-config", "--router", "unix:run/r.sock"])
    assert exit_.value.code == EXIT_USAGE
    assert "must be absolute" in capsys.readouterr().err


def test_up_runs_the_router_with_its_workers():
    spec = stack_spec(parse_args(["up", "--workers", "2"]))
    assert spec.router_workers == 2 and spec.router_replicas == 1


def test_workers_auto_is_one_per_core(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert stack_spec(parse_args(["up", "--workers", "auto"])).router_workers == 3
    for command in ("router", "epp"):
        assert parse_args([command, "--workers", "auto"]).workers == "auto"
    result = run("router", "--workers", "some")
    assert result.returncode == 2 and "expected a number or auto, got 'some'" in result.stderr


def test_envoy_config_original_dst_takes_the_routers_header():
    result = run("envoy-config", "--mode", "original-dst")
    assert result.returncode == 0
    assert "ORIGINAL_DST" in result.stdout
    assert "x-target-host" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--mode", "original-dst", "--backend", BACKENDS[0]), "--backend does not apply"),
        (("--mode", "original-dst", "--static"), "--static does not apply"),
        (
            ("--mode", "original-dst", "--control-plane", "127.0.0.1:1"),
            "--control-plane does not apply",
        ),
        (("--backend", BACKENDS[0]), "--backend applies with --static only"),
        (("--static", "--control-plane", "127.0.0.1:1"), "--control-plane does not apply"),
    ],
)
def test_envoy_config_refuses_a_flag_the_mode_ignores(capsys, flags, message):
    assert main(["envoy-config", *flags]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_envoy_config_refusal_exits_2_as_a_process():
    result = run("envoy-config", "--mode", "original-dst", "--backend", BACKENDS[0])
    assert result.returncode == 2
    assert "--backend does not apply to --mode original-dst" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_up_uses_the_given_backends_in_either_mode(tmp_path, mode):
    urls = [f"http://{BACKENDS[0]}", BACKENDS[1]]  # a URL, or host:port alone
    spec = stack_spec(
        parse_args(["up", "--mode", mode, "--backend", urls[0], "--backend", urls[1]])
    )
    assert spec.mode == mode
    assert spec.backends == spec.external_backends == BACKEND_PAIRS
    assert spec.sim_backends == ()  # no simulator starts
    stack = LocalStack(dataclasses.replace(spec, work_dir=tmp_path))
    # The control plane publishes them to the router and (override-host) to Envoy's EDS;
    # in original-dst mode Envoy connects to the one the router picked from them.
    control = yaml.safe_load(stack.write_control_plane_config().read_text())
    assert control["hosts"] == list(BACKENDS)
    router = yaml.safe_load(stack.write_router_config().read_text())
    assert router["control_plane"] == "127.0.0.1:18000"
    assert "hosts" not in router
    assert stack.bootstrap_params().backends == BACKEND_PAIRS


def test_up_defaults_to_three_simulators():
    spec = stack_spec(parse_args(["up"]))
    assert spec.external_backends == ()
    assert spec.sim_backends == (("127.0.0.11", 8000), ("127.0.0.12", 8000), ("127.0.0.13", 8000))
    assert spec.sim_args == ("--ttft-ms", "20.0", "--itl-ms", "5.0")
    assert (spec.listen, spec.router, spec.control_plane) == (
        ("127.0.0.1", 10000),
        ("127.0.0.1", 9290),
        ("127.0.0.1", 18000),
    )
    spec = stack_spec(parse_args(["up", "--backends", "2", "--sim-port", "8100"]))
    assert spec.sim_backends == (("127.0.0.11", 8100), ("127.0.0.12", 8100))


@pytest.mark.parametrize(
    "flags",
    [("--backends", "2"), ("--sim-port", "8100"), ("--sim-ttft-ms", "0"), ("--sim-itl-ms", "1")],
)
def test_up_refuses_simulator_flags_beside_backend(capsys, flags):
    assert main(["up", "--backend", BACKENDS[0], *flags]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{flags[0]} applies to the simulated fleet only" in err
    assert "--backend replaces it" in err


def test_up_refusal_exits_2_as_a_process():
    result = run("up", "--backend", f"http://{BACKENDS[0]}", "--backends", "2")
    assert result.returncode == 2
    assert "--backends applies to the simulated fleet only" in result.stderr
    assert "starting" not in result.stdout


def test_bracketed_ipv6_is_an_address(capsys):
    assert parse_args(["router", "--listen", "[::1]:50051"]).listen == "[::1]:50051"
    assert parse_args(["control-plane", "--host", "[::1]:8000"]).host == ["[::1]:8000"]
    assert parse_args(["sim", "--address", "[::1]:8000"]).address == [("::1", 8000)]
    spec = stack_spec(parse_args(["up", "--listen", "[::1]:10000", "--backend", "[::1]:8000"]))
    assert (spec.listen, spec.backends) == (("::1", 10000), (("::1", 8000),))
    listener = bootstrap(capsys, "--listen", "[::1]:10000")["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "::1", "port_value": 10000}


@pytest.mark.parametrize(
    "flags",
    [
        ("router", "--listen", "localhost:50051"),
        ("router", "--host", "127.0.0.1:70000"),
        ("envoy-config", "--listen", "::1:10000:x"),
        ("up", "--admin", "127.0.0.1"),
    ],
)
def test_a_bad_address_exits_2_naming_the_flag(capsys, flags):
    with pytest.raises(SystemExit) as exit_:
        parse_args(list(flags))
    assert exit_.value.code == EXIT_USAGE
    assert f"argument {flags[1]}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "flag", "values"),
    [
        ("router", "--routing-strategy", [s.value for s in Strategy]),
        ("up", "--routing-strategy", [s.value for s in Strategy]),
        ("router", "--key-mode", [m.value for m in KeyMode]),
        ("up", "--mode", ["override-host", "original-dst"]),
        ("envoy-config", "--mode", ["override-host", "original-dst"]),
        ("sim", "--timing", ["fixed", "model"]),
    ],
)
def test_an_invalid_choice_lists_the_allowed_values(capsys, command, flag, values):
    with pytest.raises(SystemExit) as exit_:
        parse_args([command, flag, "NOT-A-CHOICE"])
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'NOT-A-CHOICE'" in err
    for value in values:
        assert repr(value) in err


def test_envoy_config_caps_the_routers_streams_only_where_asked(capsys):
    def limits(config: dict, name: str) -> dict:
        (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
        (thresholds,) = cluster["circuit_breakers"]["thresholds"]
        return thresholds

    default = bootstrap(capsys)
    assert limits(default, "prefix_router")["max_requests"] == BootstrapParams.max_concurrent
    capped = bootstrap(capsys, "--router-max-streams", "512")
    assert limits(capped, "prefix_router")["max_requests"] == 512
    # Only the routers' streams: the backends, and the routers' connections, keep theirs.
    assert limits(capped, "prefix_router")["max_connections"] == BootstrapParams.max_concurrent
    assert limits(capped, "vllm")["max_requests"] == BootstrapParams.max_concurrent
    assert main(["envoy-config", "--router-max-streams", "0"]) == EXIT_USAGE
    assert "--router-max-streams must be 1-1000000, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "runtime"),
    [
        ("router", "extproc.adapter.service extproc.adapter.workers"),
        ("epp", "extproc.adapter.service extproc.adapter.workers"),
        ("control-plane", "extproc.control.service extproc.control.config"),
    ],
)
def test_the_deployed_processes_load_nothing_of_the_harness(command, runtime):
    # What the process imports: the CLI with its command's flags, then what its handler
    # runs. The import contracts (pyproject.toml) keep the runtime packages off the
    # harness; this keeps the CLI's command table from pulling it in.
    harness = ("extproc.bench", "extproc.stack", "extproc.sim", "extproc.replay")
    script = (
        "import importlib, sys\n"
        "from extproc.cli import parse_args\n"
        f"parse_args([{command!r}])\n"
        f"for module in {runtime.split()!r}: importlib.import_module(module)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({harness!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_command_is_listed_whichever_runs(capsys):
    with pytest.raises(SystemExit):
        parse_args(["router", "--help"])
    with pytest.raises(SystemExit):  # the router's own flags, parsed with the others unloaded
        parse_args(["router", "--no-such-flag"])
    assert "--no-such-flag" in capsys.readouterr().err
    listed = run("--help").stdout
    for command, help_text in COMMAND_HELP.items():
        assert command in listed and help_text.split()[0] in listed


def test_routers_that_end_streams_at_the_decision_get_envoys_completion_log(tmp_path, capsys):
    # up: the stack's Envoy logs completions to the routers when they end streams early.
    for flags, logged in ((["up"], False), (["up", "--stream-end", "decision"], True)):
        spec = stack_spec(parse_args(flags))
        stack = LocalStack(dataclasses.replace(spec, work_dir=tmp_path))
        assert stack.bootstrap_params().completion_log is logged
    # envoy-config: asked for with --completion-log, one log per router.
    flags = ("--router", "127.0.0.1:9290", "--router", "127.0.0.1:9291")
    manager = bootstrap(capsys, *flags, "--completion-log")["static_resources"]["listeners"][0]
    logs = manager["filter_chains"][0]["filters"][0]["typed_config"]["access_log"]
    assert len(logs) == 2
    manager = bootstrap(capsys, *flags)["static_resources"]["listeners"][0]
    assert "access_log" not in manager["filter_chains"][0]["filters"][0]["typed_config"]


def test_an_http_error_ends_in_a_line_naming_the_request(monkeypatch, capsys):
    def unreachable(_args):  # a command's request to a process that is not there
        return httpx.get("http://127.0.0.1:9/metrics", timeout=2)

    monkeypatch.setattr(extproc.cli.envoy_config, "run", unreachable)
    assert main(["envoy-config"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("prefix-router: GET http://127.0.0.1:9/metrics: ")
    assert "Traceback" not in err
