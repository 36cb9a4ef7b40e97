"""`prefix-router bench --workload long-context --quick` end to end, through the CLI: our
router alone, with overhead probes: what this test adds is the command line, the report
quoting it and the plots. test_fleet.py compares the paths (the baseline and a peer) and
covers the closed loop. It uses the older `--workload` form that
committed reports quote; tests/cli/test_bench_cli.py checks it parses as `bench long-context`."""

import subprocess
import sys

PATHS = "PREFIX_AWARE"


def test_quick_long_context_through_the_cli(tmp_path):
    argv = [
        sys.executable, "-m", "extproc", "bench", "--workload", "long-context", "--quick",
        "--out", str(tmp_path), "--paths", PATHS, "--overhead-probes", "5",
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("failed 0") == len(PATHS.split(","))
    text = (tmp_path / "long-context.md").read_text()
    assert "--quick" in text and "routing overhead p50 (ms)" in text
    # The report quotes the command as it was typed.
    assert " ".join(["prefix-router", *argv[3:]]) in text
    for path in PATHS.split(","):
        assert f"| {path} |" in text
    assert (tmp_path / "long-context-ttft.png").exists()
    assert (tmp_path / "long-context-share.png").exists()
