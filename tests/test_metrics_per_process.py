"""Each process exports its own series and the shared ones only: the router (``prefix-router
router``, and ``epp``, the same Router) none of the control plane's, and the control plane
none of the router's, so neither shows the other's as zeros. The router's are declared in
``adapter/metrics.py``, the control plane's in ``control/metrics.py``, the shared ones in
``extproc/metrics.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import extproc

# What each command loads before it serves: its CLI module, then what its run() imports.
PROCESS_MODULES = {
    "router": ("extproc.cli.router", "extproc.logs", "extproc.config", "extproc.adapter.service"),
    "epp": (
        "extproc.cli.epp",
        "extproc.logs",
        "extproc.tls",
        "extproc.config",
        "extproc.adapter.service",
    ),
    "control-plane": (
        "extproc.cli.control_plane",
        "extproc.logs",
        "extproc.control.config",
        "extproc.control.service",
    ),
}
# Counted by both: config reloads, and log lines suppressed (logs.py).
SHARED = {"prefix_router_config_reloads", "prefix_router_log_lines_suppressed"}

# Families, not samples: a labelled series nobody has counted yet has no sample.
LIST_FAMILIES = """
import importlib, json, sys
from prometheus_client import REGISTRY
for module in sys.argv[1:]:
    importlib.import_module(module)
names = [family.name for family in REGISTRY.collect()]
print(json.dumps(sorted(name for name in names if name.startswith("prefix_router_"))))
"""


def exported_families(command: str) -> set[str]:
    """The prefix_router_ families a fresh process registers once it has loaded what
    ``command`` loads, from the same tree this test imports."""
    tree = str(Path(extproc.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))
    result = subprocess.run(
        [sys.executable, "-c", LIST_FAMILIES, *PROCESS_MODULES[command]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("command", ["router", "epp"])
def test_the_router_exports_none_of_the_control_planes_series(command):
    families = exported_families(command)
    assert {"prefix_router_decisions", "prefix_router_in_flight_requests"} <= families
    assert families >= SHARED
    assert sorted(name for name in families if name.startswith("prefix_router_cp_")) == []


def test_the_control_plane_exports_none_of_the_routers_series():
    families = exported_families("control-plane")
    own = {name for name in families if name.startswith("prefix_router_cp_")}
    assert {"prefix_router_cp_xds_streams", "prefix_router_cp_hosts"} <= own
    assert families >= SHARED
    assert sorted(families - own - SHARED) == []
