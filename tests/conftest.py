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

README's test command runs two pytest-xdist workers (``-n 2 --dist loadgroup``). Two
``xdist_group``s each run in order on one worker, side by side:

- ``timed``: the tests whose bounds are about speed and load (the benchmarks, the
  reliability tier, and the integration files that time the event loop or count failed
  requests through a fault), so that no two of them run at once;
- ``pinned``: the tests that bind fixed ports or need Docker or real vLLM (the
  containers, ``up``'s defaults, the real-vLLM tier), so that no two of them collide;
  real vLLM last, as CI installs it beside the first tests (tests/vllm_install.py).

xdist hands out the larger group first, so each worker starts on one of them. Everything
else, one test at a time, fills in on whichever worker is free: the fast tier, the
in-process fuzzing, and the functional stacks on ports of their own (integration, and
unit tests behind Envoy). In a clean-clone CI run on this machine kind the timed group
took about 18 minutes of work, the pinned one 10 and the rest 12, so the two workers end
together instead of one idling for 16 minutes while the other ran both groups.
pytest stays below 9.2 until pytest-xdist groups there again (pyproject.toml).
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
# The two groups (see the docstring), and where each tier and named file goes.
TIMED, PINNED = "timed", "pinned"
GROUP_TIERS = {"containers": PINNED, "vllm": PINNED, "bench": TIMED, "reliability": TIMED}
# The order within each group, by tier: containers first, real vLLM last.
TIER_ORDER = ("containers", "bench", "reliability", "vllm")
# Files of those tiers that run in process instead: they run outside both groups.
IN_PROCESS = frozenset({TESTS / "reliability" / "test_fuzz.py"})
# Integration files in a group: those that bind the stack's default ports (pinned), and
# those that time the event loop or count failed requests through a fault with timeouts
# set for an unloaded machine (timed: the control plane's outages; beside the benchmarks,
# a CI run saw 3 of their requests fail).
GROUP_FILES = {
    TESTS / "integration" / "test_up.py": PINNED,
    TESTS / "integration" / "test_epp_workers.py": PINNED,
    TESTS / "integration" / "test_event_loop.py": TIMED,
    TESTS / "integration" / "test_control_plane.py": TIMED,
}
# Fixtures that start real vLLM outside its tier (the wire format's cross-check): CI
# installs vLLM beside the first tests, so these run last on their worker.
VLLM_FIXTURES = frozenset({"vllm"})


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
        group = group_of(item.path.resolve(), tier)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items[:] = sorted(items, key=run_rank)


def group_of(path: Path, tier: str) -> str | None:
    """The xdist group a test file runs in (see the docstring), or None."""
    if path in GROUP_FILES:
        return GROUP_FILES[path]
    if path in IN_PROCESS:
        return None
    return GROUP_TIERS.get(tier)


def run_rank(item: pytest.Item) -> float:
    """Where a test runs in its order: the grouped tiers in TIER_ORDER's order, a group's
    integration files just before real vLLM; then the rest, and last the rest that needs
    real vLLM (a stable sort keeps the order within each)."""
    if item.get_closest_marker("xdist_group") is None:
        needs_vllm = bool(VLLM_FIXTURES & set(getattr(item, "fixturenames", ())))
        return len(TIER_ORDER) + 1 + needs_vllm
    tier = tier_of(item.path)
    if tier in TIER_ORDER:
        return TIER_ORDER.index(tier)
    return TIER_ORDER.index("vllm") - 0.5
