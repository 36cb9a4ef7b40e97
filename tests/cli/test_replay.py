"""``prefix-router replay``: the table on stdout, and every refusal naming its cause."""

import json
import random
import subprocess
import sys

import pytest

from extproc import cli
from extproc.adapter.observers import TrafficLogObserver
from extproc.adapter.routing import Router
from extproc.adapter.traffic_log import TrafficLog
from extproc.config import RouterConfig

HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")


@pytest.fixture
def log(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "traffic.log"
    traffic = TrafficLog(path, 1 << 20, 2)
    router = Router(
        RouterConfig(hosts=HOSTS, routing_strategy="RANDOM"),
        random.Random(1),
        observers=(TrafficLogObserver(traffic),),
    )
    for n in range(40):
        body = {"model": "m", "messages": [{"role": "user", "content": f"doc {n % 4} " * 300}]}
        router.finish(router.route({}, json.dumps(body).encode()))
    traffic.close()
    return path


def test_the_table_lists_every_configuration_and_recommends_one(log, capsys):
    argv = ["replay", str(log), "--instances", "3", "--cache-tokens", "50000"]
    argv += ["--hosts", *HOSTS, "--concurrency-thresholds", "8", "32"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("| 3 x 50,000 |") == 1 + 1 + 2 + 2
    assert out.count("(recommended)") == 1
    assert "40 requests, 6 configurations" in out


def exit_code(argv: list[str]) -> int:
    """What ``prefix-router`` exits with: argparse's refusals exit from inside."""
    try:
        return cli.main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        ([], 2, "the following arguments are required: --instances, --cache-tokens"),
        (["--instances", "3", "--cache-tokens", "9", "--strategies", "FAST"], 2, "invalid choice"),
        (["--instances", "0", "--cache-tokens", "9"], 2, "invalid config: instances=0"),
        (["--instances", "3", "--cache-tokens", "9", "--hosts", "localhost"], 2, "--hosts"),
        (["--instances", "3", "--cache-tokens", "9", "--block-bytes", "700"], 1, "not a multiple"),
    ],
)
def test_a_refusal_names_its_cause(log, capsys, flags, code, message):
    assert exit_code(["replay", str(log), *flags]) == code
    assert message in capsys.readouterr().err


def test_an_absent_log_exits_1_with_its_path(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc",
            "replay",
            str(tmp_path / "none.log"),
            "--instances",
            "2",
            "--cache-tokens",
            "9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"no traffic log at {tmp_path / 'none.log'}" in done.stderr


def test_out_without_the_bench_extra_names_it_before_replaying(log, capsys, monkeypatch, tmp_path):
    """The stored run's plot needs matplotlib ([bench]); without it, ``--out`` stops at once
    with one line naming what to install, and the table alone still works."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["replay", str(log), "--instances", "3", "--cache-tokens", "50000"]
    out = tmp_path / "out"
    assert cli.main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (
        "prefix-router: replay --out needs matplotlib, which is not installed: "
        "pip install 'envoy-prefix-router[bench]'\n"
    )
    assert not out.exists()
    assert cli.main(argv) == 0
    assert "(recommended)" in capsys.readouterr().out
