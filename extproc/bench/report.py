"""Benchmark reports: a markdown table with the command and machine, plus PNG plots."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path


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
