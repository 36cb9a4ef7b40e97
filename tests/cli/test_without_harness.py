"""Where the benchmark harness is not installed (the router's image: .dockerignore leaves
out extproc/bench and extproc/cli/bench), every other command loads and runs, and `bench`
refuses in one line naming the harness, with no traceback. The harness is made absent in
a fresh process as an import would find it there: ``sys.modules[name] = None``."""

import json
import random
import subprocess
import sys

import pytest

from extproc.adapter.routing import Router
from extproc.cli import COMMAND_MODULES
from extproc.cli.common import HARNESS_COMMANDS, HARNESS_MODULES
from extproc.config import RouterConfig

RUNTIME_COMMANDS = [name for name in COMMAND_MODULES if name not in HARNESS_COMMANDS]
HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000")
# Imports the harness's packages would satisfy: a module of either, or either itself.
HARNESS_PREFIXES = tuple(name + "." for name in HARNESS_MODULES)


def run_without_the_harness(*argv: str, check_loaded: bool = True):
    """``prefix-router ARGV`` in a process where the harness cannot be imported; then, on
    stderr's last line, every harness module the process loaded (none, it should be)."""
    code = (
        "import sys\n"
        f"for name in {HARNESS_MODULES!r}:\n"
        "    sys.modules[name] = None\n"
        "from extproc.cli import main\n"
        "try:\n"
        "    code = main(sys.argv[1:])\n"
        "except SystemExit as exited:\n"
        "    code = exited.code\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({HARNESS_PREFIXES!r}))\n"
        "print(f'loaded: {loaded}', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60
    )
    *err, loaded = done.stderr.splitlines() or [""]
    assert loaded == "loaded: []", done.stderr
    return done.returncode, done.stdout, "".join(line + "\n" for line in err)


def test_every_runtime_command_module_imports_without_the_harness():
    modules = [COMMAND_MODULES[name] for name in RUNTIME_COMMANDS]
    code = (
        "import importlib, sys\n"
        f"for name in {HARNESS_MODULES!r}:\n"
        "    sys.modules[name] = None\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        "import extproc.reporting, extproc.replay.report\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert set(RUNTIME_COMMANDS) >= {"up", "router", "epp", "sim", "replay", "control-plane"}


@pytest.mark.parametrize("command", RUNTIME_COMMANDS)
def test_every_runtime_command_parses_its_flags_without_the_harness(command):
    code, out, err = run_without_the_harness(command, "--help")
    assert code == 0, err
    assert out.startswith(f"usage: prefix-router {command}")


def test_the_command_list_still_names_bench():
    code, out, err = run_without_the_harness("--help")
    assert code == 0, err
    assert "bench" in out and "replay" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "overhead", "--quick"],
        ["bench", "--workload", "overhead", "--quick"],  # the form the reports quote
        ["bench", "render"],
        ["bench", "--help"],
        ["bench"],
    ],
)
def test_bench_names_the_missing_harness_in_one_line(argv):
    code, out, err = run_without_the_harness(*argv)
    assert code == 1
    assert out == ""
    assert err == (
        "prefix-router: bench: the benchmark harness (extproc.bench) is not installed in this "
        "image; run it from a source checkout: pip install -e '.[bench]'\n"
    )


def test_replay_writes_its_report_without_the_harness(tmp_path):
    # `replay --out` renders through extproc/reporting.py, which the image holds.
    log = tmp_path / "traffic.log"
    router = Router(
        RouterConfig(hosts=HOSTS, routing_strategy="RANDOM", traffic_log=str(log)),
        random.Random(1),
    )
    for n in range(12):
        body = {"model": "m", "messages": [{"role": "user", "content": f"doc {n % 3} " * 300}]}
        router.finish(router.route({}, json.dumps(body).encode()))
    router.close()  # stops the traffic log's writer: the log is whole
    out_dir = tmp_path / "out"
    code, out, err = run_without_the_harness(
        "replay",
        str(log),
        "--instances",
        "2",
        "--cache-tokens",
        "50000",
        "--strategies",
        "RANDOM",
        "--out",
        str(out_dir),
    )
    assert code == 0, err
    assert "12 requests" in out
    assert sorted(path.name for path in out_dir.iterdir()) == [
        "replay.json",
        "replay.md",
        "replay.png",
    ]
    assert "# What-if replay of a traffic log" in (out_dir / "replay.md").read_text()
