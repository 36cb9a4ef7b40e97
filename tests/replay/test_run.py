"""Reading a log for a replay: streamed, oldest file first, what is not a record skipped
and counted, and a log that cannot be replayed refused with the reason."""

import json
from types import SimpleNamespace

import pytest

from extproc.errors import ReplayError
from extproc.replay.configs import PREFIX_AWARE, RANDOM, Grid, ReplayConfig
from extproc.replay.run import replay

from .logs import record_log

GRID = Grid(strategies=(RANDOM,), instances=(3,), cache_tokens=(10_000,))


def requests(count: int, start: float = 0.0) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            body={"model": "m", "messages": [{"role": "user", "content": f"doc {n % 5} " * 200}]},
            headers={},
            at_s=start + n * 0.1,
        )
        for n in range(count)
    ]


def test_every_rotated_file_is_replayed_oldest_first(tmp_path):
    path = record_log(tmp_path / "traffic.log", requests(300), max_bytes=16 * 1024, files=50)
    assert len(list(tmp_path.glob("traffic.log.*"))) >= 3
    found = replay(path, GRID)
    assert found.records == 300 and found.skipped == 0
    assert found.span_s == pytest.approx(29.9, abs=0.01)
    assert sum(found.results[0].shares) == pytest.approx(1.0)


def test_lines_that_are_not_records_and_another_block_size_are_skipped(tmp_path):
    path = record_log(tmp_path / "traffic.log", requests(20))
    other = record_log(tmp_path / "other.log", requests(5), block_bytes=1024)
    with path.open("a") as log:
        log.write("not json\n" + '{"t": 1}\n')
        log.write(other.read_text())
        log.write(json.dumps({"cut": "short"})[:5])
    found = replay(path, GRID)
    assert (found.records, found.skipped, found.other_block_size) == (20, 3, 5)


def test_limit_stops_early(tmp_path):
    path = record_log(tmp_path / "traffic.log", requests(50))
    assert replay(path, GRID, limit=10).records == 10


def test_a_log_that_cannot_be_replayed_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ReplayError, match="no traffic log at"):
        replay(tmp_path / "absent.log", GRID)
    empty = tmp_path / "empty.log"
    empty.write_text("garbage\n")
    with pytest.raises(ReplayError, match=r"no traffic-log records \(1 lines skipped\)"):
        replay(empty, GRID)
    path = record_log(tmp_path / "traffic.log", requests(5), block_bytes=512)
    finer = [ReplayConfig(PREFIX_AWARE, 3, 10_000, 32, block_bytes=64)]
    with pytest.raises(ReplayError, match="not a multiple"):
        replay(path, finer)
