"""`prefix-router bench WORKLOAD`: each workload lists and takes only its own flags, and the
older `bench --workload WORKLOAD` form reaches the same runner."""

import argparse
import re
from pathlib import Path
from typing import get_args

import pytest

from extproc.bench import fleet_events
from extproc.bench.workloads import WorkloadName
from extproc.cli import EXIT_USAGE, main, parse_args
from extproc.cli.bench import WORKLOADS, upgrade_argv

FLEET = get_args(WorkloadName)
OTHERS = (
    "overhead",
    "fleet-events",
    "long-streams",
    "real-vllm",
    "scale-event",
    "prefix-index",
    "kv-events",
    "http-clients",
    "sim-vs-vllm",
    "soak",
    "saturation",
    "concurrency",
    "bodies",
    "replay",
    "shadow",
)
FLEET_FLAGS = [
    "--rate",
    "--time-scale",
    "--paths",
    "--report-name",
    "--overhead-probes",
    "--closed-loop",
    "--prefix-length",
    "--duration",
    "--quick",
    "--out",
]


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_workload_has_a_subcommand_of_its_own():
    assert set(WORKLOADS) == {*FLEET, *OTHERS}
    assert len(WORKLOADS) == len(FLEET) + len(OTHERS)
    runners = {name: workload.run for name, workload in WORKLOADS.items()}
    # The fleet workloads share one runner; every other workload has its own.
    assert len({runners[name] for name in FLEET}) == 1
    assert len({runners[name] for name in (*OTHERS, FLEET[0])}) == len(OTHERS) + 1


def test_bench_help_lists_the_workloads_and_both_forms(capsys):
    text = help_text(capsys, "bench")
    for name in WORKLOADS:
        assert name in text
    assert "bench WORKLOAD --help" in text
    assert "--workload WORKLOAD" in text


@pytest.mark.parametrize("workload", FLEET)
def test_fleet_workload_help_lists_only_fleet_flags(capsys, workload):
    text = help_text(capsys, "bench", workload)
    for flag in FLEET_FLAGS:
        assert flag in text
    for other in ["--requests", "--rounds", "--instances", "--device", "--workload"]:
        assert other not in text


def test_overhead_help_lists_only_overhead_flags(capsys):
    text = help_text(capsys, "bench", "overhead")
    for flag in ["--rounds", "--duration", "--quick", "--out"]:
        assert flag in text
    assert "seconds per sample (default 10)" in text
    for other in ["--paths", "--rate", "--requests", "--instances", "--closed-loop"]:
        assert other not in text


@pytest.mark.parametrize(
    ("workload", "flags", "absent"),
    [
        ("soak", ["--requests", "--quick", "--out"], ["--rounds", "--paths", "--duration"]),
        (
            "saturation",
            ["--rounds", "--duration", "--body-bytes", "--quick"],
            ["--requests", "--paths"],
        ),
        ("real-vllm", ["--instances", "--device", "--out"], ["--quick", "--rounds", "--paths"]),
        ("scale-event", ["--paths", "--quick", "--out"], ["--rate", "--rounds", "--duration"]),
        ("fleet-events", ["--rounds", "--quick", "--out"], ["--duration", "--paths"]),
        ("prefix-index", ["--quick", "--out"], ["--rounds", "--duration", "--paths"]),
        ("kv-events", ["--quick", "--out"], ["--rounds", "--duration", "--paths"]),
        ("sim-vs-vllm", ["--out"], ["--quick", "--rounds", "--paths"]),
        ("replay", ["--rate", "--duration", "--quick", "--out"], ["--paths", "--rounds"]),
        ("shadow", ["--rate", "--duration", "--quick", "--out"], ["--paths", "--rounds"]),
    ],
)
def test_other_workloads_list_their_own_flags(capsys, workload, flags, absent):
    text = help_text(capsys, "bench", workload)
    for flag in flags:
        assert flag in text
    for flag in absent:
        assert flag not in text


def test_a_flag_of_another_workload_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["bench", "long-context", "--requests", "5"])
    assert exit_.value.code == EXIT_USAGE
    assert "unrecognized arguments: --requests 5" in capsys.readouterr().err


def namespace(argv: list[str]) -> dict:
    values = vars(parse_args(argv))
    assert values.pop("argv") == argv  # kept as typed, for the report's command line
    return values


@pytest.mark.parametrize(
    ("legacy", "current"),
    [
        (
            ["bench", "--workload", "long-context", "--quick", "--paths", "RANDOM"],
            ["bench", "long-context", "--quick", "--paths", "RANDOM"],
        ),
        (
            ["bench", "--rate", "16", "--workload=hot-spot", "--out", "/tmp/x"],
            ["bench", "hot-spot", "--rate", "16", "--out", "/tmp/x"],
        ),
        (["bench", "--quick", "--work", "overhead"], ["bench", "overhead", "--quick"]),
        (["bench", "--workload", "soak", "--requests", "9"], ["bench", "soak", "--requests", "9"]),
    ],
)
def test_the_workload_flag_form_parses_as_the_subcommand(legacy, current):
    assert upgrade_argv(legacy) == current
    old, new = namespace(legacy), namespace(current)
    assert old == new
    assert old["handler"] is WORKLOADS[new["workload"]].run


def test_argv_without_the_workload_flag_is_left_alone():
    for argv in (["bench", "overhead", "--quick"], ["up", "--workload", "x"], ["bench"], []):
        assert upgrade_argv(argv) == argv


def test_an_unknown_workload_lists_the_workloads(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["bench", "--workload", "nope"])
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err
    for name in WORKLOADS:
        assert repr(name) in err


def test_both_forms_run_the_same_runner_with_the_same_options(monkeypatch, tmp_path):
    seen: list[fleet_events.FleetEventOptions] = []

    def fake_run(options: fleet_events.FleetEventOptions) -> Path:
        seen.append(options)
        report = tmp_path / "fleet-events.md"
        report.write_text("report")
        return report

    monkeypatch.setattr(fleet_events, "run", fake_run)
    out = str(tmp_path)
    assert main(["bench", "--workload", "fleet-events", "--quick", "--out", out]) == 0
    assert main(["bench", "fleet-events", "--quick", "--out", out]) == 0
    assert main(["bench", "fleet-events", "--rounds", "5", "--out", out]) == 0
    quick = fleet_events.FleetEventOptions(prefixes=50, rounds=1, out_dir=tmp_path)
    assert seen == [quick, quick, fleet_events.FleetEventOptions(rounds=5, out_dir=tmp_path)]


def test_defaults_are_unchanged():
    fleet = argparse.Namespace(**namespace(["bench", "long-context"]))
    assert (fleet.rate, fleet.time_scale, fleet.prefix_length) == (4.0, 1.0, 8192)
    assert (fleet.overhead_probes, fleet.closed_loop, fleet.duration) == (0, 0, None)
    assert (fleet.paths, fleet.report_name, fleet.quick) == (None, None, False)
    # Ad-hoc runs go to a scratch directory; only --out docs/benchmarks writes the reports.
    assert fleet.out == Path("bench-results")
    overhead = argparse.Namespace(**namespace(["bench", "overhead"]))
    assert (overhead.rounds, overhead.duration, overhead.out) == (3, None, Path("bench-results"))
    real = argparse.Namespace(**namespace(["bench", "real-vllm"]))
    assert (real.instances, real.device) == (3, "cpu")


def test_a_quick_run_never_writes_the_committed_reports(capsys):
    assert main(["bench", "long-context", "--quick", "--out", "docs/benchmarks"]) == EXIT_USAGE
    assert "--quick" in capsys.readouterr().err


def test_render_renders_a_stored_run_again(tmp_path):
    import shutil

    committed = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
    shutil.copy(committed / "prefix-index.json", tmp_path)
    assert main(["bench", "render", str(tmp_path / "prefix-index.json")]) == 0
    assert (tmp_path / "prefix-index.md").read_text() == (committed / "prefix-index.md").read_text()


def test_render_refuses_a_file_that_is_not_a_stored_run(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text("{}")
    assert main(["bench", "render", str(other)]) == EXIT_USAGE
    assert "not a stored run" in capsys.readouterr().err


def test_concurrency_levels_must_be_ascending_counts(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["bench", "concurrency", "--levels", "3000,1000"])
    assert exit_.value.code == 2
    assert "--levels: expected ascending counts" in capsys.readouterr().err
    args = parse_args(["bench", "concurrency", "--levels", "1000,3000"])
    assert args.levels == (1000, 3000)


def test_a_burst_runs_without_a_gateway_and_at_least_one_round(capsys):
    args = parse_args(["bench", "concurrency", "--burst", "--levels", "3000"])
    assert args.burst and args.rounds is None and args.levels == (3000,)  # run_burst: 3
    assert main(["bench", "concurrency", "--burst", "--gateway", "istio"]) == EXIT_USAGE
    assert "--burst runs without --gateway" in capsys.readouterr().err
    assert main(["bench", "concurrency", "--burst", "--rounds", "0"]) == EXIT_USAGE
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert main(["bench", "concurrency", "--burst", "--variants", "defaults,sometimes"]) == 2
    assert "variants: unknown ['sometimes']" in capsys.readouterr().err


def test_a_quick_burst_keeps_the_rounds_and_variants_asked_for(monkeypatch):
    from extproc.bench import burst

    seen = []
    monkeypatch.setattr(burst, "run", lambda options: seen.append(options) or {"results": []})
    command = ["bench", "concurrency", "--burst", "--quick", "--out", "x"]
    assert main(command) == 0
    assert main([*command, "--levels", "150,300", "--rounds", "8"]) == 0
    assert main(["bench", "concurrency", "--burst", "--variants", "defaults,never shed"]) == 0
    quick, ladder, chosen = seen
    assert (quick.levels, quick.rounds, quick.variants) == ((600,), 1, ("defaults",))
    assert (quick.stream_s, quick.itl_s) == (2.0, 0.25)
    assert (ladder.levels, ladder.rounds, ladder.variants) == ((150, 300), 8, ("defaults",))
    assert chosen.rounds == 3 and chosen.variants == ("defaults", "never shed")


def test_saturation_body_bytes_must_be_a_positive_size(capsys):
    assert parse_args(["bench", "saturation"]).body_bytes is None
    assert parse_args(["bench", "saturation", "--body-bytes", "32768"]).body_bytes == 32768
    for bad in ("0", "-1", "32k"):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["bench", "saturation", "--body-bytes", bad])
        assert exit_.value.code == 2
        assert f"--body-bytes: expected a size in bytes of at least 1, got '{bad}'" in (
            capsys.readouterr().err
        )


def test_real_vllm_subsets_and_the_unshared_comparison_are_validated(capsys):
    args = parse_args(["bench", "real-vllm"])
    assert (args.scenarios, args.unshared_workers, args.no_restart, args.report_name) == (
        None,
        (),
        False,
        None,
    )
    args = parse_args(
        ["bench", "real-vllm", "--scenarios", "many-documents,rag", "--unshared-workers", "2,4"]
    )
    assert args.scenarios == ("many-documents", "rag") and args.unshared_workers == (2, 4)
    for flag, bad, said in (
        ("--scenarios", "many-docs", "unknown scenario 'many-docs': choose from documents"),
        ("--unshared-workers", "1", "expected worker counts of at least 2, got '1'"),
        ("--unshared-workers", "two", "expected worker counts of at least 2, got 'two'"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["bench", "real-vllm", flag, bad])
        assert f"{flag}: {said}" in capsys.readouterr().err


def test_readme_names_every_workload():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = readme[readme.index("with WORKLOAD one of") :].split(", runs", 1)[0]
    names = set(re.findall(r"[a-z][a-z-]*[a-z]", listed.replace("\n", " ")))
    assert set(WORKLOADS) <= names, set(WORKLOADS) - names


def test_a_quick_fleet_run_smooths_cache_pressure_over_a_short_time(monkeypatch, tmp_path):
    from extproc.bench import fleet

    seen = []
    monkeypatch.setattr(fleet, "run", lambda options: seen.append(options) or [])
    command = ["bench", "long-context", "--paths", "RANDOM", "--out", str(tmp_path)]
    assert main([*command, "--quick"]) == 0
    assert main(command) == 0
    quick, full = seen
    assert quick.rate_time_constant_s == fleet.QUICK_RATE_TIME_CONSTANT_S
    assert full.rate_time_constant_s is None  # the control plane's own default
