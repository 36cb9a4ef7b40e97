"""The overhead benchmark end to end, at smoke size."""

import os
import shutil

import pytest

from extproc.bench.overhead import OverheadOptions, chat_bodies, run

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None and not os.environ.get("CI"),
    reason="wrk is not installed (apt-get install wrk); CI installs it and never skips",
)


def test_chat_bodies_have_the_exact_size_and_distinct_prompts():
    bodies = chat_bodies(4, 8192)
    assert {len(b) for b in bodies} == {8192}
    assert len(set(bodies)) == 4


@needs_wrk
def test_overhead_benchmark_writes_table_and_plot(tmp_path):
    report = run(OverheadOptions(duration_s=1, rounds=1, out_dir=tmp_path))
    text = report.read_text()
    for path in ("| c=1 | direct |", "| c=1 | envoy |", "| c=16 | envoy+router |"):
        assert path in text
    # No path may fail requests: every row's error count is 0.
    rows = [line for line in text.splitlines() if line.startswith("| c=")]
    assert all(line.rstrip(" |").endswith("| 0") for line in rows if line.count("|") == 8)
    assert (tmp_path / "overhead.png").stat().st_size > 10_000
