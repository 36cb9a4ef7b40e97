"""The console script: help text and exit codes, run as a real process."""

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", *args], capture_output=True, text=True, timeout=60
    )


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
    ],
)
def test_config_errors_exit_2_naming_the_field(args, field):
    result = run(*args)
    assert result.returncode == 2
    assert field in result.stderr
    assert "allowed" in result.stderr


def test_envoy_config_prints_a_bootstrap_with_the_given_backends():
    result = run("envoy-config", "--mode", "original-dst", "--backend", "127.0.0.21:9000")
    assert result.returncode == 0
    assert "ORIGINAL_DST" in result.stdout
    assert "x-target-host" in result.stdout
