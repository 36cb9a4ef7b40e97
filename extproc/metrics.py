"""The series both processes export, declared once.

Each process declares its own series in one module: the router's (``prefix-router
router`` and ``epp``, the same Router) in ``adapter/metrics.py``, the control plane's
(``prefix_router_cp_*``) in ``control/metrics.py``. This module holds only what both
count, through the modules they share (``logs.py``) or each for itself (config reloads),
so neither process exports the other's series.
"""

from __future__ import annotations

from prometheus_client import Counter

LOG_LINES_SUPPRESSED = Counter(
    "prefix_router_log_lines_suppressed",
    "Log lines a client could cause that were not written: past their rate (see logs.py)",
    ["event"],
)
CONFIG_RELOADS = Counter(
    "prefix_router_config_reloads",
    "Config file reloads, by result: applied, rejected (invalid; the old config stays), "
    "failed (an unexpected error; the old config stays)",
    ["result"],
)
