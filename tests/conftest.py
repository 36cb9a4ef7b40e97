"""Test tiers, from where a test lives (README.md, "Test tiers").

Every test gets one tier marker from its top-level directory under tests/: ``unit`` for
the in-process and property tests of one area (picker, index, events, adapter, control,
sim, replay, stack, cli, deploy, the files in tests/ itself, and any directory not named
below), and its own for each directory of real processes or long runs: ``integration``,
``reliability``, ``bench``, ``vllm``, ``containers``.

``envoy`` marks a test that runs the real Envoy binary: every test in integration/ and
reliability/ (stacks of real processes behind Envoy), every test that uses a fixture
that starts a stack with Envoy (the real-vLLM stack), and tests marked by hand elsewhere
(a benchmark's smoke run, a manifest validated by ``envoy --mode validate``).

``fast`` is the default tier: ``unit`` tests that do not run Envoy (``pytest -m fast``).
CI runs every tier.

README's test command runs two pytest-xdist workers (``-n 2 --dist loadgroup``): every
test of real processes is in one ``xdist_group``, run in order on one worker as in a
serial run, while the other worker takes the in-process tests (the fast tier and the
in-process fuzzing), which bind only ports of their own. The group starts with the
functional tiers (integration, then containers), so that the benchmarks and the real-vLLM
tier, whose bounds are about speed and load, run once the other worker is done (it has
about six minutes of work). pytest stays below 9.2 until pytest-xdist groups there again
(pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Directories whose tests start real processes, run long or need Docker or real vLLM:
# each is its own tier. Every other directory is "unit".
SLOW_TIERS = ("integration", "reliability", "bench", "vllm", "containers")
# Every test there runs behind the real Envoy binary.
ENVOY_TIERS = frozenset({"integration", "reliability"})
# Fixtures that start a stack with the real Envoy binary in it.
ENVOY_FIXTURES = frozenset({"vllm_stack"})
# Slow-tier files that run in process, beside the fast tier (see the docstring).
IN_PROCESS = frozenset({TESTS / "reliability" / "test_fuzz.py"})
# The xdist group of the tests of real processes, and its first tiers, in order.
STACKS = "stacks"
STACKS_FIRST = ("integration", "containers")


def tier_of(path: Path) -> str:
    """The tier of a test file: its top-level directory under tests/, if a slow one."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:  # not under tests/ (a path given on the command line elsewhere)
        return "unit"
    top = parts[0] if len(parts) > 1 else ""
    return top if top in SLOW_TIERS else "unit"


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        item.add_marker(tier)
        if tier in ENVOY_TIERS or ENVOY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("envoy")
        if tier == "unit" and item.get_closest_marker("envoy") is None:
            item.add_marker("fast")
        elif item.path.resolve() not in IN_PROCESS:
            item.add_marker(pytest.mark.xdist_group(STACKS))
    items[:] = sorted(items, key=run_rank)


def run_rank(item: pytest.Item) -> int:
    """Where a test runs: the stacks' functional tiers first, then the rest of the stacks,
    then the in-process tests (a stable sort keeps the order within each)."""
    if item.get_closest_marker("xdist_group") is None:
        return len(STACKS_FIRST) + 1
    tier = tier_of(item.path)
    return STACKS_FIRST.index(tier) if tier in STACKS_FIRST else len(STACKS_FIRST)
