"""Benchmark reports: each run is stored as JSON, and its markdown and PNG plots are
rendered from that JSON alone (``rerender`` does it again from a committed file)."""

from __future__ import annotations

import importlib
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} cores ({cpu}), {memory_gib:.0f} GiB, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )


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


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# Each stored run names the generator that renders it; a generator module has
# ``render(data) -> str`` and, if it draws plots, ``render_plots(data, out_dir, name)``.
RENDERERS = {
    "bodies": "extproc.bench.bodies",
    "burst": "extproc.bench.burst",
    "concurrency": "extproc.bench.concurrency",
    "fleet": "extproc.bench.fleet_render",
    "fleet-events": "extproc.bench.fleet_events",
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


def _renderer(kind: str) -> Any:
    if kind not in RENDERERS:
        raise ValueError(f"no renderer for stored runs of kind {kind!r}")
    return importlib.import_module(RENDERERS[kind])


def render_stored(data: dict[str, Any], out_dir: Path, name: str) -> Path:
    """Write ``name``.md (and its plots) in ``out_dir`` from a stored run alone."""
    module = _renderer(data["kind"])
    path = out_dir / f"{name}.md"
    path.write_text(module.render(data))
    if hasattr(module, "render_plots"):
        module.render_plots(data, out_dir, name)
    return path


def write_rendered(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    """Store a run as ``name``.json, then render its report from what was stored, so the
    committed markdown is by construction a rendering of the committed data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, default=str) + "\n"
    (out_dir / f"{name}.json").write_text(text)
    return render_stored(json.loads(text), out_dir, name)


def rerender(json_path: Path) -> Path:
    """Render the report beside a stored run again, from the JSON alone."""
    return render_stored(json.loads(json_path.read_text()), json_path.parent, json_path.stem)
