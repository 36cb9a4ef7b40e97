"""Runs the replay accuracy smoke N times and appends each run's errors to
replay_smoke_runs.json, the stored runs the smoke's bounds are derived from
(tests/bench/test_replay_accuracy.py), each with its real and predicted hit rates.
Usage: python tests/bench/replay_smoke_runs.py N [WHERE: the machine, and what else ran]"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from extproc.bench.replay_accuracy import ReplayAccuracyOptions, compared, quick, run

STORED = Path(__file__).with_name("replay_smoke_runs.json")


def main(count: int, where: str) -> None:
    stored = json.loads(STORED.read_text())
    for _ in range(count):
        with tempfile.TemporaryDirectory() as out:
            options = quick(ReplayAccuracyOptions(workloads=("long-context",), out_dir=Path(out)))
            (workload,) = run(options)["workloads"]
        errors = {
            row["config"]: {
                "hit_rate_points": round(row["hit_rate_error"], 2),
                "share_points": round(row["share_error"], 2),
                "real_hit_rate": round(row["measured"]["hit_rate"], 4),
                "predicted_hit_rate": round(row["predicted"]["hit_rate"], 4),
                "predicted_overflow_rate": round(row["predicted"]["overflow_rate"], 4),
            }
            for row in compared(workload)
        }
        stored["runs"].append({"where": where, "errors": errors})
        STORED.write_text(json.dumps(stored, indent=1) + "\n")
        print(errors, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), " ".join(sys.argv[2:]) or "replay_smoke_runs.py")
