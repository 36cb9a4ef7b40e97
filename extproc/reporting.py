"""Stored runs and the reports rendered from them, for whatever writes one: the replay
(``prefix-router replay --out``, in the router's image) and the benchmark harness
(``extproc/bench``, which is not in the image and imports this module, never the reverse).

A run is stored as JSON, and its markdown (and plots, where its renderer draws them) is
rendered from that JSON alone, so a committed report is by construction a rendering of the
committed data.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol


class Renderer(Protocol):
    """A module that renders one kind of stored run: ``render(data) -> str`` and, if it
    draws plots, ``render_plots(data, out_dir, name)`` too (looked up, not required)."""

    def render(self, data: dict[str, Any], /) -> str: ...


def machine_description() -> str:
    """Cores, CPU model, memory and OS of this machine, as the reports quote it."""
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


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_stored(data: dict[str, Any], out_dir: Path, name: str, renderer: Renderer) -> Path:
    """Write ``name``.md (and its plots) in ``out_dir`` from a stored run alone."""
    path = out_dir / f"{name}.md"
    path.write_text(renderer.render(data))
    render_plots = getattr(renderer, "render_plots", None)
    if render_plots is not None:
        render_plots(data, out_dir, name)
    return path


def write_rendered(out_dir: Path, name: str, data: dict[str, Any], renderer: Renderer) -> Path:
    """Store a run as ``name``.json, then render its report from what was stored."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, default=str) + "\n"
    (out_dir / f"{name}.json").write_text(text)
    return render_stored(json.loads(text), out_dir, name, renderer)
