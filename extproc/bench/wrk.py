"""Drive wrk (a C load generator) and parse its report.

wrk keeps the client's CPU cost small and equal across the compared paths, which matters
on a 2-core machine where client, Envoy, router and backends share the cores.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from extproc.errors import RouterError

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


class WrkMissing(RouterError):
    """The wrk binary is not installed."""


@dataclass(frozen=True)
class WrkResult:
    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests_per_s: float
    requests: int
    errors: int


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not match:
        raise ValueError(f"unparseable wrk latency {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse(output: str) -> WrkResult:
    percentiles = dict(re.findall(r"^\s+(50|90|99)%\s+(\S+)$", output, re.MULTILINE))
    rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.MULTILINE)
    total = re.search(r"^\s+(\d+) requests in", output, re.MULTILINE)
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    if not (percentiles and rate and total):
        raise ValueError(f"unparseable wrk output:\n{output}")
    errors = int(non_2xx.group(1)) if non_2xx else 0
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    return WrkResult(
        _ms(percentiles["50"]),
        _ms(percentiles["90"]),
        _ms(percentiles["99"]),
        float(rate.group(1)),
        int(total.group(1)),
        errors,
    )


def post_script(
    path: Path,
    request_path: str,
    bodies: list[bytes],
    headers: Mapping[str, str] | None = None,
) -> Path:
    """A wrk Lua script that POSTs ``bodies`` in rotation, with ``headers`` (JSON's
    content type if none)."""
    literals = ",\n".join(f"[==[{b.decode()}]==]" for b in bodies)
    fields = headers or {"Content-Type": "application/json"}
    table = ", ".join(f"[{_lua_string(k)}] = {_lua_string(v)}" for k, v in fields.items())
    path.write_text(
        f"local bodies = {{\n{literals}\n}}\nlocal i = 0\n"
        "request = function()\n  i = i % #bodies + 1\n"
        f'  return wrk.format("POST", "{request_path}", '
        f"{{{table}}}, bodies[i])\nend\n"
    )
    return path


def _lua_string(text: str) -> str:
    # For printable ASCII, JSON's string escapes are a subset of Lua's.
    return json.dumps(text)


def run(url: str, script: Path, connections: int, duration_s: float) -> WrkResult:
    binary = shutil.which("wrk")
    if binary is None:
        raise WrkMissing("wrk is not installed (Debian: apt-get install wrk)")
    argv = [
        binary, "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--latency",
        "--timeout", "10s", "-s", str(script), url,
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
    if result.returncode != 0:
        raise RouterError(f"wrk failed ({result.returncode}): {result.stderr.strip()}")
    return parse(result.stdout)
