"""Real vLLM (the CPU build) behind the whole stack. CI installs it; nothing here skips
there. Elsewhere the tier runs when PREFIX_ROUTER_VLLM_PYTHON names a Python with vllm."""

from __future__ import annotations

import os

import pytest

from extproc.bench.real_vllm import RealVllmOptions, real_vllm_stack
from extproc.stack.vllm import VllmUnavailable, vllm_python

from ..vllm_install import wait_for_vllm_install
from .tier import TIER_RANDOM, TIER_SCENARIOS, TIER_WORKERS


@pytest.fixture(scope="session")
def vllm_interpreter() -> str:
    wait_for_vllm_install()
    try:
        return vllm_python()
    except VllmUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"the real-vLLM tier must run in CI: {error}")
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def options() -> RealVllmOptions:
    return RealVllmOptions(
        out_dir=None,
        scenarios=TIER_SCENARIOS,
        router_workers=TIER_WORKERS,
        random_scenarios=TIER_RANDOM,
        restart_workers=None,  # the report's (real_vllm_restart.py); not CI's
        peers=(),  # the report's (real_vllm_peers.py); not CI's
    )


@pytest.fixture(scope="session")
def vllm_stack(vllm_interpreter, options, tmp_path_factory):
    with real_vllm_stack(options, tmp_path_factory.mktemp("real-vllm")) as (stack, servers):
        yield stack, servers
