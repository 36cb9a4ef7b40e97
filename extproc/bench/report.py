"""Benchmark reports: each run is stored as JSON, and its markdown and PNG plots are
rendered from that JSON alone (``rerender`` does it again from a committed file).

Storing and rendering, and the helpers the replay's report shares (``machine_description``,
``markdown_table``), live in ``extproc/reporting.py``, which the router's image holds; this
module adds what only the harness needs: the table of renderers by kind, and the tools'
versions and medians the benchmarks quote.
"""

from __future__ import annotations

import importlib
import json
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from extproc import reporting
from extproc.reporting import machine_description, markdown_table

__all__ = [
    "RENDERERS",
    "machine_description",
    "markdown_table",
    "median",
    "render_stored",
    "rerender",
    "tool_version",
    "write_rendered",
]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def tool_version(argv: Sequence[str]) -> str:
    """The first line a tool prints about its version (wrk exits 1 even then)."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except OSError:
        return "unavailable"
    lines = (result.stdout or result.stderr).strip().splitlines()
    if not lines:
        return "unknown"
    return lines[0].split("version:", 1)[-1].strip()


# Each stored run names the generator that renders it; a generator module has
# ``render(data) -> str`` and, if it draws plots, ``render_plots(data, out_dir, name)``.
RENDERERS = {
    "bodies": "extproc.bench.bodies",
    "burst": "extproc.bench.burst",
    "concurrency": "extproc.bench.concurrency",
    "fleet": "extproc.bench.fleet_render",
    "fleet-events": "extproc.bench.fleet_events",
    "http-clients": "extproc.bench.http_clients",
    "kv-events": "extproc.bench.kv_events",
    "long-streams": "extproc.bench.long_streams",
    "overhead": "extproc.bench.overhead",
    "prefix-index": "extproc.bench.prefix_index",
    "real-vllm": "extproc.bench.real_vllm",
    "replay": "extproc.replay.report",
    "replay-accuracy": "extproc.bench.replay_accuracy",
    "shadow": "extproc.bench.shadow",
    "scale-event": "extproc.bench.scale_event",
    "sim-vs-vllm": "extproc.bench.sim_vs_vllm",
}


def _renderer(kind: str) -> reporting.Renderer:
    if kind not in RENDERERS:
        raise ValueError(f"no renderer for stored runs of kind {kind!r}")
    return importlib.import_module(RENDERERS[kind])


def render_stored(data: dict[str, Any], out_dir: Path, name: str) -> Path:
    """Write ``name``.md (and its plots) in ``out_dir`` from a stored run alone, by the
    renderer its kind names."""
    return reporting.render_stored(data, out_dir, name, _renderer(data["kind"]))


def write_rendered(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    """Store a run as ``name``.json, then render its report from what was stored, so the
    committed markdown is by construction a rendering of the committed data."""
    return reporting.write_rendered(out_dir, name, data, _renderer(data["kind"]))


def rerender(json_path: Path) -> Path:
    """Render the report beside a stored run again, from the JSON alone."""
    return render_stored(json.loads(json_path.read_text()), json_path.parent, json_path.stem)
