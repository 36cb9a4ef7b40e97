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

``fast`` is the tier to run while working: ``unit`` tests that do not run Envoy
(``pytest -m fast``, about two minutes). A bare ``pytest``, README's test command and CI
run every tier.

README's test command runs two pytest-xdist workers (``-n 2 --dist loadgroup``). The
tests whose bounds are about speed and load (the benchmarks, the reliability tier, real
vLLM) and those that bind fixed ports (the containers, ``up``'s defaults) are one
``xdist_group``, run in order on one worker as in a serial run, containers first. The
other worker takes everything else, one test at a time: the fast tier, the in-process
fuzzing, and the functional stacks on ports of their own (integration, and unit tests
behind Envoy), and last the tests outside the vLLM tier that need real vLLM, which CI
installs beside the first tests (tests/vllm_install.py); by the time the reliability and
real-vLLM tiers start, it is done.

Why not two groups side by side (the timed tests on one worker, Docker, fixed ports and
real vLLM on the other)? In a clean-clone CI run that split (36d807c) the tests took
1,942 s instead of 1,690, and three benchmark smoke runs failed: real vLLM keeps both
cores busy, so beside it the benchmarks ran 1.5 times as long (990 s against 650) and so
did the real-vLLM tier (840 s against 563), and Envoy's 0.5 s message timeout ran out on a
33 MiB body (a 504 for the router's 413).
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
# The tiers of the serial group (see the docstring), the first of them first.
SERIAL_TIERS = ("containers", "bench", "reliability", "vllm")
# Files there that run in process instead: they go beside the serial group.
IN_PROCESS = frozenset({TESTS / "reliability" / "test_fuzz.py"})
# Integration files that bind the stack's default ports, time the event loop, or count
# failed requests through a fault with timeouts set for an unloaded machine (the control
# plane's outages: beside the benchmarks, a CI run saw 3 of their requests fail).
SERIAL_FILES = frozenset(
    TESTS / "integration" / name
    for name in (
        "test_up.py",
        "test_epp_workers.py",
        "test_event_loop.py",
        "test_control_plane.py",
    )
)
SERIAL = "serial"
# Fixtures that start real vLLM outside its tier (the wire format's cross-check). CI
# installs vLLM beside the first tests (tests/vllm_install.py), so these run last on
# their worker, as the vLLM tier runs last in the serial group.
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
        if is_serial(item.path.resolve(), tier):
            item.add_marker(pytest.mark.xdist_group(SERIAL))
    items[:] = sorted(items, key=run_rank)


def is_serial(path: Path, tier: str) -> bool:
    """Whether a test runs in the serial group (see the docstring)."""
    return path in SERIAL_FILES or (tier in SERIAL_TIERS and path not in IN_PROCESS)


def run_rank(item: pytest.Item) -> int:
    """Where a test runs: the serial group's tiers in SERIAL_TIERS's order, then the
    serial integration files, then the rest, and last the rest that needs real vLLM (a
    stable sort keeps the order within each)."""
    if item.get_closest_marker("xdist_group") is None:
        needs_vllm = bool(VLLM_FIXTURES & set(getattr(item, "fixturenames", ())))
        return len(SERIAL_TIERS) + 1 + needs_vllm
    tier = tier_of(item.path)
    return SERIAL_TIERS.index(tier) if tier in SERIAL_TIERS else len(SERIAL_TIERS)
