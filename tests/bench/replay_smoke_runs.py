"""Runs the replay accuracy smoke N times and appends each run's errors to
replay_smoke_runs.json, the stored runs the smoke's bounds are derived from
(tests/bench/test_replay_accuracy.py). Usage: python tests/bench/replay_smoke_runs.py N"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from extproc.bench.replay_accuracy import ReplayAccuracyOptions, compared, quick, run

STORED = Path(__file__).with_name("replay_smoke_runs.json")


def main(count: int) -> None:
    stored = json.loads(STORED.read_text())
    for _ in range(count):
        with tempfile.TemporaryDirectory() as out:
            options = quick(ReplayAccuracyOptions(workloads=("long-context",), out_dir=Path(out)))
            (workload,) = run(options)["workloads"]
        errors = {
            row["config"]: {
                "hit_rate_points": round(row["hit_rate_error"], 2),
                "share_points": round(row["share_error"], 2),
            }
            for row in compared(workload)
        }
        stored["runs"].append({"where": "replay_smoke_runs.py", "errors": errors})
        STORED.write_text(json.dumps(stored, indent=1) + "\n")
        print(errors, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
