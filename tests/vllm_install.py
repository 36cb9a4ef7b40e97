"""Waiting for CI's real-vLLM install.

.ci/run starts the tests while vLLM still installs in the background (it takes minutes,
and only a few tests need it, late in each worker's order: tests/conftest.py). It names
a status file in PREFIX_ROUTER_VLLM_INSTALL_STATUS and writes the install's exit status
there when the install ends, its log beside it (``.log`` for ``.status``); a test that
needs vLLM waits here for it. Without the variable (every run but CI's) there is nothing
to wait for.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extproc.stack.processes import wait_until

STATUS_ENV = "PREFIX_ROUTER_VLLM_INSTALL_STATUS"
# CI's whole setup, the install among it, took about 4 minutes; this is far past that.
INSTALL_TIMEOUT_S = 900.0


def wait_for_vllm_install(timeout_s: float = INSTALL_TIMEOUT_S) -> None:
    """Return once CI's vLLM install has ended well; fail the test if it failed."""
    named = os.environ.get(STATUS_ENV)
    if not named:
        return
    status = Path(named)
    wait_until(
        status.exists, timeout_s, what=f"the real-vLLM install to end ({status})", interval_s=1.0
    )
    code = status.read_text().strip()
    if code != "0":
        log = status.with_suffix(".log")  # .ci/run's install log, beside the status
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        said = "\n".join(tail)
        pytest.fail(f"the real-vLLM install failed (exit status {code}); {log}:\n{said}")
