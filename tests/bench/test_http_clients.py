"""The HTTP-client benchmark, at smoke size: both clients read every event of every
stream, each round counts its own process's CPU, and the report renders from the stored
data alone."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from extproc.bench import http_clients
from extproc.bench.report import write_rendered

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def test_a_smoke_run_reads_every_stream_with_each_client_and_renders(tmp_path):
    options = http_clients.HttpClientOptions(levels=(30,), stream_s=0.5, itl_s=0.1, rounds=2)
    data = http_clients.run(options)
    rounds = data["rounds"]
    # Interleaved: round by round, each client in turn, each round in the other order.
    assert [r["client"] for r in rounds] == ["aiohttp", "httpx", "httpx", "aiohttp"]
    for result in rounds:
        assert result["completed"] == 30, result
        assert result["events"] == 30 * options.tokens, result
        assert result["cpu_s"] > 0, result
        assert result["sim_cpu_s"] > 0, result
    rows = http_clients.summary(data)
    assert [(r["client"], r["rounds"], r["all_completed"]) for r in rows] == [
        ("aiohttp", 2, True),
        ("httpx", 2, True),
    ]
    page = write_rendered(tmp_path, "http-clients", json.loads(json.dumps(data))).read_text()
    assert "| 30 | httpx | 2 | yes |" in page
    assert "httpx's costs" in page


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"clients": ("requests",)}, "clients"),
        ({"rounds": 0}, "rounds"),
        ({"levels": ()}, "levels"),
        ({"clients": ("httpx", "httpx")}, "clients"),
        ({"clients": ()}, "clients"),
        ({"stream_s": 0}, "stream_s"),
        ({"itl_s": -0.1}, "itl_s"),
    ],
)
def test_options_name_the_bad_field(changes, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        http_clients.HttpClientOptions(**changes)


def test_the_load_generators_use_the_client_the_committed_run_found_cheaper():
    # A tripwire on what each load generator imports at module level, not a proof of what
    # it streams through.
    stored = json.loads((REPORTS / "http-clients.json").read_text())
    chosen = http_clients.cheaper(stored)
    for name in http_clients.LOAD_GENERATORS:
        module = importlib.import_module(name)
        clients = {n for n in http_clients.CLIENTS if isinstance(vars(module).get(n), ModuleType)}
        assert clients == {chosen}, (name, clients)


def test_the_cheaper_client_is_read_at_the_largest_level_from_whole_rounds_only():
    def run(client, level, cpu_s, completed):
        return {"client": client, "level": level, "completed": completed, "events": 10 * level,
                "cpu_s": cpu_s, "sim_cpu_s": 0.5, "wall_s": 1.0}  # fmt: skip

    options = {"levels": [10, 100], "clients": ["aiohttp", "httpx"]}
    rounds = [run("aiohttp", 10, 0.5, 10), run("httpx", 10, 0.1, 10)]
    rounds += [run("aiohttp", 100, 0.2, 100), run("httpx", 100, 0.9, 100)]
    assert http_clients.cheaper({"options": options, "rounds": rounds}) == "aiohttp"
    rounds[-1] = run("httpx", 100, 0.9, 99)
    with pytest.raises(ValueError, match="did not complete every stream of 100"):
        http_clients.cheaper({"options": options, "rounds": rounds})
    one_client = {"levels": [100], "clients": ["aiohttp"]}
    with pytest.raises(ValueError, match="did not measure every client"):
        http_clients.cheaper({"options": one_client, "rounds": rounds[2:3]})
