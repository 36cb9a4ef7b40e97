"""Waiting for CI's real-vLLM install (tests/vllm_install.py)."""

from __future__ import annotations

import threading

import pytest

from extproc.stack.processes import WaitTimeout

from .vllm_install import STATUS_ENV, wait_for_vllm_install


def test_nothing_to_wait_for_without_the_variable(monkeypatch):
    monkeypatch.delenv(STATUS_ENV, raising=False)
    wait_for_vllm_install(timeout_s=0.1)


def test_waits_for_the_status_and_returns_once_the_install_ended_well(monkeypatch, tmp_path):
    status = tmp_path / "vllm.status"
    monkeypatch.setenv(STATUS_ENV, str(status))
    timer = threading.Timer(0.3, status.write_text, args=("0\n",))
    timer.start()
    try:
        wait_for_vllm_install(timeout_s=10)
    finally:
        timer.cancel()
    assert status.read_text() == "0\n"


def test_a_failed_install_fails_the_test_with_its_log(monkeypatch, tmp_path):
    status = tmp_path / "vllm.status"
    status.write_text("1\n")
    (tmp_path / "vllm.log").write_text("\n".join(f"line {n}" for n in range(30)))
    monkeypatch.setenv(STATUS_ENV, str(status))
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_for_vllm_install(timeout_s=1)
    message = str(failed.value)
    assert "exit status 1" in message and "line 29" in message and "line 9\n" not in message


def test_an_install_that_never_ends_times_out_naming_the_file(monkeypatch, tmp_path):
    status = tmp_path / "vllm.status"
    monkeypatch.setenv(STATUS_ENV, str(status))
    with pytest.raises(WaitTimeout, match=r"vllm\.status"):
        wait_for_vllm_install(timeout_s=1.5)
