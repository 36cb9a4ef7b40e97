"""A base install (`pip install -e .`, no `[bench]` extra): `up` and every command's help
still work, and `bench` says what to install, in one line and exit status 1, instead of a
traceback (possibly after a run). The extra's modules are made unimportable here as they
would be absent: ``sys.modules[name] = None``."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from extproc.bench import fleet_events
from extproc.cli import main
from extproc.cli.common import EXTRAS

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "pip install 'envoy-prefix-router[bench]'"
BENCH_MODULES = EXTRAS["bench"]


def test_the_modules_looked_for_are_what_the_bench_extra_installs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", requirement)[0] for requirement in extras["bench"]}
    base = {r.split(">")[0] for r in project["dependencies"]}
    assert set(BENCH_MODULES) == {"matplotlib"}
    assert set(BENCH_MODULES) <= names  # their distributions are named as the modules
    assert not set(BENCH_MODULES) & base
    # The project's one HTTP client: the runtime and the local stack use it too.
    assert "httpx" in base
    assert "httpx" not in names
    assert "envoy-prefix-router[bench]" in extras["test"]


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_a_workload_without_the_extra_names_the_module_and_the_install(
    monkeypatch, capsys, tmp_path, module
):
    def must_not_run(options: fleet_events.FleetEventOptions) -> None:
        raise AssertionError("the workload ran without the bench extra")

    monkeypatch.setattr(fleet_events, "run", must_not_run)
    monkeypatch.setitem(sys.modules, module, None)
    assert main(["bench", "fleet-events", "--quick", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"prefix-router: bench needs {module}, which is not installed: {INSTALL}\n"


def test_the_older_workload_flag_form_and_render_say_it_too(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for argv in (
        ["bench", "--workload", "overhead", "--quick", "--out", str(tmp_path)],
        ["bench", "render", str(tmp_path / "none.json")],
    ):
        assert main(argv) == 1
        assert capsys.readouterr().err.endswith(
            f"needs matplotlib, which is not installed: {INSTALL}\n"
        )


def run_without_the_extra(*argv: str) -> subprocess.CompletedProcess[str]:
    """``prefix-router ARGV`` in a process where the bench extra's modules cannot be
    imported, as on a base install."""
    code = (
        "import sys\n"
        f"for name in {BENCH_MODULES!r}:\n"
        "    sys.modules[name] = None\n"
        "from extproc.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60
    )


def test_a_base_install_runs_the_cli_and_refuses_bench_in_one_line(tmp_path):
    # Every command registers (so `up`, README's first command, and its help work)...
    for argv in (["up", "--help"], ["replay", "--help"], ["bench", "overhead", "--help"]):
        done = run_without_the_extra(*argv)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: prefix-router {' '.join(argv[:-1])}")
    # ...and a benchmark names what to install, with no traceback.
    done = run_without_the_extra("bench", "overhead", "--quick", "--out", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr == (
        f"prefix-router: bench needs matplotlib, which is not installed: {INSTALL}\n"
    )
    assert list(tmp_path.iterdir()) == []
