"""Traffic logs for the replay tests: a real Router writes them, routing workload requests
at their arrival times (the log's clock is the schedule's)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extproc.adapter.observers import TrafficLogObserver
from extproc.adapter.routing import Router
from extproc.adapter.traffic_log import TrafficLog
from extproc.bench.workloads import BenchRequest
from extproc.config import RouterConfig
from extproc.replay.fleet import addresses

START = 1.8e9


def record_log(
    path: Path,
    requests: Sequence[BenchRequest],
    instances: int = 7,
    max_bytes: int = 1 << 30,
    files: int = 2,
    **settings: Any,
) -> Path:
    log = TrafficLog(path, max_bytes, files)
    now = [0.0]
    log._clock = lambda: START + now[0]
    config = RouterConfig(hosts=addresses(instances), **{"routing_strategy": "RANDOM", **settings})
    router = Router(config, random.Random(1), observers=(TrafficLogObserver(log),))
    for request in requests:
        now[0] = request.at_s
        headers = {k.lower(): v for k, v in request.headers.items()}
        router.finish(router.route(headers, json.dumps(request.body).encode()))
    log.close()
    return path
